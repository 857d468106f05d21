// Layer 5, backend: OdcBackend, the c10d backend registered as "odc" (its face to c10d).
// Depends on the options (options.hpp) and the channels (channel.hpp: the transport and
// protocol per device); never on a concrete transport. Decoupled mode: decoupled.hpp.
//
// All-gather and reduce-scatter (and their coalesced forms) run on the
// one-sided protocol over a transport chosen by tensor device: host shared
// memory for CPU tensors, the CUDA transport for GPU tensors (its memory opened by the
// peers through CUDA IPC, or NVSHMEM's heap). Every other collective is
// delegated to an inner backend (gloo for CPU, NCCL for CUDA) created lazily by
// a factory the Python layer provides.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <array>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>  // also std::once_flag
#include <string>

#include "channel.hpp"
#include "options.hpp"

namespace odc {

class OdcBackend;
// Makes a group's inner backend for a device type ("cpu": gloo, "cuda": NCCL), which serves
// the collectives odc delegates: (the group's store, rank, size, options, device type). One
// factory serves a group and every group split from it.
using InnerFactory = std::function<c10::intrusive_ptr<c10d::Backend>(
    const c10::intrusive_ptr<c10d::Store>&, int, int, const c10::intrusive_ptr<odc::Options>&,
    const std::string&)>;
// Told of each group split from this one, once made (ODC_STATS_DIR keeps their counters).
using CreatedHook = std::function<void(const c10::intrusive_ptr<OdcBackend>&)>;

// Argument helpers shared by the backend's collectives (checks.cpp).
DType to_dtype(at::ScalarType t, const char* api);  // TypeError for a dtype odc cannot reduce
const char* reduce_op_name(const c10d::ReduceOp& op);  // "BAND"
bool is_bitwise(const c10d::ReduceOp& op);           // BAND, BOR, BXOR
std::string describe(const at::Tensor& t);         // "float32[4, 8] on cuda:0"
c10::Device device_of(const std::vector<at::Tensor>& ts);  // the first tensor's (ValueError: none)
// Defined, on `device`, contiguous: else a ValueError naming `api` and `what`. `dense`: dense
// and non-overlapping suffices (a channels-last tensor, say), for the collectives that treat
// a tensor as its memory's elements, as NCCL does (all-reduce, reduce, broadcast).
void check_tensor(const at::Tensor& t, const c10::Device& device, const char* api,
                  const char* what, bool dense = false);
// Whether odc's own reductions take `op` on `dtype` (the same on every rank: where they do not,
// e.g. complex or fp8 tensors, a collective goes to the inner backend, which may).
bool odc_reduces(at::ScalarType dtype, const c10d::ReduceOp& op);
// An all-gather's (ag) or reduce-scatter's tensors: as many outputs as inputs, each pair
// checked, of one dtype, the sizes right for `world` ranks. Returns their device.
c10::Device check_collective(const std::vector<at::Tensor>& outputs,
                             const std::vector<at::Tensor>& inputs, bool ag, int world,
                             const char* api);

// The group's counters (stats()); counted on every collective, so an array of atomics, not a
// map of names.
enum class Stat : int {
  AllGatherOps,
  AllGatherBytes,
  ReduceScatterOps,
  ReduceScatterBytes,
  RegisteredOps,
  RegisteredAllocations,
  RegisteredFallbacks,
  RegisteredPoolBytes,
  AllGatherPushOps,
  DirectOps,
  DirectInPlaceOps,
  DirectPushedOps,
  FusedOps,
  FusedBlocks,
  CopyEngineOps,
  CopyEngineBlocks,
  DelegatedOps,
  CrossHostOps,
  OwnAllReduceOps,
  OwnReduceOps,
  OwnBroadcastOps,
  OwnAllGatherOps,
  OwnReduceScatterOps,
  OwnExchangeOps,
  OwnBarrierOps,
  DecoupledGets,
  DecoupledAccumulates,
  DecoupledSyncs,
  kCount
};
const char* stat_name(Stat s);

class OdcBackend final : public c10d::Backend {
 public:
  // options: its group_name and global_ranks_in_group name this group (empty ranks: the
  // default group, global rank = group rank).
  OdcBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
             c10::intrusive_ptr<odc::Options> options, InnerFactory inner,
             CreatedHook on_split = nullptr);
  ~OdcBackend() override;

  const std::string getBackendName() const override { return "odc"; }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  // Reaches the transports already set up (their waits and launches read it) and the inner
  // backends. From Python: group.set_timeout(timedelta) (torch's _set_pg_timeout skips
  // backends other than NCCL and gloo).
  void setTimeout(std::chrono::milliseconds timeout) override;
  // This group's options, as made (getBackendOptions hands out a copy).
  const odc::Options& options() const { return *options_; }
  // init_process_group(device_id=...): DeviceMesh and split_group then split groups from
  // this one instead of creating them anew (new_group still creates them anew).
  bool supportsSplitting() const override { return true; }
  // Sets up the device's transport now (collective over the group, as every rank passes
  // its device_id to init_process_group / new_group) instead of at the first collective.
  void eagerConnectSingleDevice(at::Device device) override;
  // The odc backend of the group of `ranks` (this group's ranks, sorted) for its members,
  // nullptr elsewhere. Nothing is exchanged here: the new group sets up its transports at
  // its first collective, among its members only.
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;
  // destroy_process_group: stop and release the inner backends now, so their worker
  // threads are joined here and not while the interpreter finalizes.
  void shutdown() override;
  void abort() override;
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return seq_; }

  // Registered memory (pool.hpp): FSDP2's set_allocate_memory_from_process_group_for_comm
  // allocates its all-gather and reduce-scatter buffers here; collectives whose input lies in
  // it run zero-copy. An allocation that finds no room grows the pool by an arena
  // (collective: every rank allocates the same sizes in the same order, so every rank grows
  // there); past ODC_POOL_BYTES, or on a transport that does not map every peer, it hands out
  // ordinary memory (the staged path; counted in stats()).
  bool supportsTensorAlloc(c10::DeviceIndex deviceIdx) override { return true; }
  at::Tensor allocateTensor(long size, at::TensorOptions options = {}) override;

  // One-sided collectives.
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;

  // Delegated collectives.
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplitSizes,
                                               std::vector<int64_t>& inputSplitSizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                               int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // Counters for tests and monitoring: ops and bytes moved one-sidedly.
  std::map<std::string, uint64_t> stats() const;
  // Dynamic work sharing (odc.balance): the value of the group-wide counter `key` before
  // adding `amount` (an atomic fetch-add in the group's store); `forget` drops a counter.
  int64_t claim(const std::string& key, int64_t amount);
  void forget(const std::string& key);
  // Small values shared by the group (odc.balance: the ranks' measured speeds); lookup waits
  // for the key up to the group's timeout.
  void publish(const std::string& key, const std::string& value);
  std::string lookup(const std::string& key);
  // Whether odc serves a collective FSDP does not issue itself on `device` (ODC_SELF_SERVE), of
  // `bytes` per rank (SIZE_MAX where ranks may pass different sizes: never small). Raises for
  // a captured one that neither can serve (NCCL's group never ran: no set-up inside a capture).
  bool serves_itself(const c10::Device& device, size_t bytes);

  // The inner backend for a device type ("cpu" / "cuda"), created on first use.
  c10::intrusive_ptr<c10d::Backend> inner(c10::DeviceType type);
  // Where this group's ranks are on several hosts that odc's transports do not connect
  // (Channel::hosts; "" where they do), set up on `device` at the first call.
  std::string hosts(const c10::Device& device);
  // The group's ranks in the default group.
  std::vector<int> global_ranks() const;

 private:
  // registered.cpp: growing the channel's pool
  bool grow_pool(Channel& ch, const c10::Device& device, size_t need);
  void agree_on_growth(const c10::Device& device, size_t n, size_t bytes, size_t cap);
  // Decoupled mode's arena (decoupled.hpp) runs its one-sided ops as this group's collectives:
  // under its lock, on its channel, with its sequence numbers and counters.
  friend class DecoupledArena;
  enum class Kind { AllGather, ReduceScatter };
  void release_inners(bool abort);
  // The inner backend where the group spans hosts odc does not connect on `device`: it then
  // serves the group's all-gathers and reduce-scatters (counted as cross_host_ops; noted
  // once on stderr by group rank 0). nullptr: odc serves them.
  c10::intrusive_ptr<c10d::Backend> across_hosts(const c10::Device& device);
  std::atomic<bool> across_hosts_noted_{false};
  c10::intrusive_ptr<c10d::Work> run(Kind kind, std::vector<at::Tensor>& outputs,
                                     std::vector<at::Tensor>& inputs, bool async_op,
                                     const c10d::ReduceOp* op, const char* api);
  Channel& channel(const c10::Device& device);
  // How one tensor of an all-gather or reduce-scatter moves: decided by path_of, the same on
  // every rank (from what every rank sees alike), then issued by issue_direct / issue_staged /
  // issue_registered (collective_plan.cpp).
  struct Path {
    // Direct: memory allocated anywhere, each input read in place once the peers map it
    // (Protocol::all_gather_direct), on transports that do (ODC_ZERO_COPY).
    enum class Way { Staged, Registered, RegisteredPush, Direct } way = Way::Staged;
    // Registered: every rank's input (pull, reduce-scatter) or output (push) as this GPU
    // reaches it, and the buffer's place in the pool (checked by the peers).
    std::vector<const char*> at;
    RegisteredId id;
  };
  Path path_of(Channel& ch, bool ag, const at::Tensor& in, const at::Tensor& out,
               size_t per_rank) const;
  // The all-gather (ag) or reduce-scatter of each input into its output, each on its path, in
  // one transport operation (collective_plan.cpp).
  void issue_collective(Channel& ch, void* stream, uint64_t seq, bool ag,
                        std::vector<at::Tensor>& inputs, std::vector<at::Tensor>& outputs,
                        const std::vector<ReduceSpec>& specs, RedOp red_op);
  // One tensor's collective: its input and output, and its bytes per rank.
  struct Tensors {
    const at::Tensor& in;
    const at::Tensor& out;
    size_t per_rank;
  };
  // Each issues one tensor's collective on its path and returns the bytes it moved.
  uint64_t issue_direct(Channel& ch, bool ag, const Tensors& t, const ReduceSpec& spec,
                        RedOp red_op, uint64_t seq);
  uint64_t issue_staged(Channel& ch, bool ag, const Tensors& t, const ReduceSpec& spec,
                        RedOp red_op, uint64_t seq);
  uint64_t issue_registered(Channel& ch, const Path& path, bool ag, const Tensors& t,
                            const ReduceSpec& spec, RedOp red_op, uint64_t seq);
  // The counters of the engine that ran the last operation (fused_ops, copy_engine_...).
  void count_engine(Channel& ch);
  ReduceSpec reduce_spec(const at::Tensor& t, const c10d::ReduceOp& op, const char* api,
                         std::vector<at::Tensor>& factors, RedOp* red_op);
  uint64_t desc(OpKind kind, const at::Tensor& t, uint64_t bytes, RedOp op = RedOp::Sum,
                bool reduces = false, int root = 0) const;
  // Runs body(channel, stream, seq) as one collective on `device`: on the caller's current
  // stream (async_op: the group's side stream, after the current one), with scratch tensors
  // allocated on that stream; a failure breaks the group; returns its Work. ends_with_op: the
  // body's last action on the stream is a transport operation, whose end event the Work reuses.
  using Body = std::function<void(Channel&, void* stream, uint64_t seq)>;
  c10::intrusive_ptr<c10d::Work> launch(const c10::Device& device, bool async_op,
                                        c10d::OpType type, std::vector<at::Tensor> outputs,
                                        std::vector<at::Tensor> keep, const Body& body,
                                        bool blocking = false, bool ends_with_op = false);
  // ---- The collectives odc serves itself (own_collectives.cpp), when serves_itself().
  void own_all_reduce(Channel& ch, void* stream, uint64_t seq, const at::Tensor& t,
                      const ReduceSpec& spec, uint64_t rs_desc, uint64_t ag_desc);
  c10::intrusive_ptr<c10d::Work> own_allreduce(std::vector<at::Tensor>& tensors,
                                               const c10d::ReduceOp& op, bool async_op,
                                               const char* api);
  c10::intrusive_ptr<c10d::Work> own_reduce(std::vector<at::Tensor>& tensors,
                                            const c10d::ReduceOptions& opts);
  c10::intrusive_ptr<c10d::Work> own_broadcast(std::vector<at::Tensor>& tensors,
                                               const c10d::BroadcastOptions& opts);
  c10::intrusive_ptr<c10d::Work> own_allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs,
                                               const c10d::AllgatherOptions& opts);
  c10::intrusive_ptr<c10d::Work> own_reduce_scatter(std::vector<at::Tensor>& outputs,
                                                    std::vector<std::vector<at::Tensor>>& inputs,
                                                    const c10d::ReduceScatterOptions& opts);
  c10::intrusive_ptr<c10d::Work> own_exchange(at::Tensor& output, const at::Tensor& input,
                                              Protocol::Exchange x, bool async_op,
                                              c10d::OpType type, const char* api);
  c10::intrusive_ptr<c10d::Work> own_alltoall_base(at::Tensor& output, at::Tensor& input,
                                                   std::vector<int64_t>& out_splits,
                                                   std::vector<int64_t>& in_splits,
                                                   const c10d::AllToAllOptions& opts);
  c10::intrusive_ptr<c10d::Work> own_alltoall(std::vector<at::Tensor>& outputs,
                                              std::vector<at::Tensor>& inputs,
                                              const c10d::AllToAllOptions& opts);
  c10::intrusive_ptr<c10d::Work> own_scatter(std::vector<at::Tensor>& outputs,
                                             std::vector<std::vector<at::Tensor>>& inputs,
                                             const c10d::ScatterOptions& opts);
  c10::intrusive_ptr<c10d::Work> own_gather(std::vector<std::vector<at::Tensor>>& outputs,
                                            std::vector<at::Tensor>& inputs,
                                            const c10d::GatherOptions& opts);
  c10::intrusive_ptr<c10d::Work> own_barrier(const c10::Device& device);
  void check_usable();
  // Once, at the group's first use: init_process_group leaves some groups with odc without
  // a default backend type that has a backend in the group: "cpu:gloo,cuda:odc" gets none
  // (it compares the plugin registry's upper-case name with the backend string's lower-case
  // one), a default group whose default map names odc gets GLOO or NCCL (it assumes those),
  // and destroy_process_group then warns "No backend of type N found ...". Set the type
  // PyTorch meant to set for a custom backend (CUSTOM: this one).
  void settle_default_backend_type();
  std::once_flag default_type_once_;

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<odc::Options> options_;
  std::shared_ptr<std::atomic<int64_t>> timeout_ms_;  // options_->timeout, shared with the transports
  InnerFactory inner_factory_;
  CreatedHook on_split_;
  std::map<c10::DeviceType, Channel> channels_;
  std::mutex inner_mu_;  // guards inners_; held while a factory (Python) creates one
  std::map<c10::DeviceType, c10::intrusive_ptr<c10d::Backend>> inners_;
  mutable std::mutex mu_;  // ops on one group may be issued from several threads
  std::string broken_;  // set once a communication error left the group unusable
  uint64_t seq_ = 0;
  std::array<std::atomic<uint64_t>, static_cast<size_t>(Stat::kCount)> stats_{};  // relaxed: counts only
  void count(Stat s, uint64_t n) { stats_[static_cast<size_t>(s)].fetch_add(n, std::memory_order_relaxed); }
};

}  // namespace odc
