// Layer 5, backend: decoupled mode's one bound object. An arena made collectively by a
// group's backend (OdcBackend.create_arena) on one device; torch_odc_backend/decoupled.py
// drives it. It holds its backend, so the backend's transport (where the arena's memory
// lives) outlives it; after the group is shut down its calls raise instead of touching it.
// Depends on the backend (backend.hpp) and the arena (arena.hpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "arena.hpp"
#include "backend.hpp"

namespace odc {

class DecoupledArena {
 public:
  // Collective over the backend's group: lays out the arena for these parameter groups (per
  // group: shard elements, parameter element size, accumulator elements) on `device`.
  static std::shared_ptr<DecoupledArena> create(c10::intrusive_ptr<OdcBackend> backend,
                                                const c10::Device& device,
                                                const std::vector<int64_t>& shard_numel,
                                                const std::vector<int64_t>& param_elem_size,
                                                const std::vector<int64_t>& grad_numel);

  // Act on this rank; get and accumulate touch peers' arenas one-sidedly. finish is the
  // minibatch's synchronisation (collective).
  void publish(int64_t group, const at::Tensor& shard);
  void announce(int64_t epoch);
  void get(int64_t group, const at::Tensor& out, int64_t epoch);
  void accumulate(int64_t group, const at::Tensor& in);
  // groups_too: also say this rank is done with every group (where early takes may wait)
  void finish(int64_t epoch, bool groups_too = false);
  void take(int64_t group, const at::Tensor& out);
  // Early reduction: this rank put everything of `group` for `epoch` (on the current stream,
  // after its accumulates); take `group`'s accumulator once every rank did (on CUDA the
  // current stream waits for them, not the host; on CPU the calling thread waits).
  void group_done(int64_t group, int64_t epoch);
  void take_when_done(int64_t group, const at::Tensor& out, int64_t epoch);
  // CUDA: a stream of the arena's own for the early reductions, made at the first call (a
  // cudaStream_t as an integer; 0 on CPU). take_when_done waits there for the peers: on a
  // pool stream, NCCL's or another user's work could queue behind that wait.
  int64_t side_stream();
  // Collective: gives the arena's memory back (no operation on it may be in flight on any
  // rank); false where the transport keeps it (NVSHMEM), then it stays usable. Every later
  // call on a released arena raises.
  bool release();
  ~DecoupledArena();
  int64_t size();  // bytes of its shared layout on each rank

 private:
  DecoupledArena(c10::intrusive_ptr<OdcBackend> backend, c10::Device device,
                 std::unique_ptr<Arena> arena, Transport* transport, Arenas* arenas);
  void check_group(int64_t group, const char* what) const;
  // Runs body under the group's lock, as a collective: a communication failure breaks the group.
  template <typename F>
  void call(F&& body);
  // Runs fn between the transport's begin_op / end_op on the current stream (CUDA).
  template <typename F>
  void op(Ring ring, F&& fn);

  c10::intrusive_ptr<OdcBackend> backend_;
  c10::Device device_;
  std::unique_ptr<Arena> arena_;
  Transport* transport_;  // owned by backend_'s channel of device_
  Arenas* arenas_;        // the same transport's arenas
  void* side_stream_ = nullptr;
  bool released_ = false;
};

}  // namespace odc
