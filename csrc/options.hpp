// Layer: configuration. odc's backend options, one typed struct (what c10d's Options pattern
// asks of a backend: create(), clone(), and the base's name, timeout, group name and ranks).
// Depends on c10d's Backend::Options only. torch_odc_backend/config.py fills it from the
// ODC_* environment; the fields' defaults here are the backend's defaults.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace odc {

// Whether this build has the NVSHMEM transport (ODC_WITH_NVSHMEM=1): the only one of odc's
// transports that reaches GPUs of other hosts.
#ifdef ODC_WITH_NVSHMEM
constexpr bool kBuiltWithNvshmem = true;
#else
constexpr bool kBuiltWithNvshmem = false;
#endif
// Whether this build moves CUDA tensors itself (ODC_WITH_CUDA).
#ifdef ODC_WITH_CUDA
constexpr bool kBuiltWithCuda = true;
#else
constexpr bool kBuiltWithCuda = false;
#endif

// How CUDA peers are reached (ODC_TRANSPORT). A group with ranks on several hosts that no
// odc transport connects hands its collectives to its inner NCCL (gloo) group instead.
enum class TransportKind : int {
  Auto = 0,     // CUDA IPC on this host; peers on other hosts over NVSHMEM where built
  Nvshmem = 1,  // every peer over NVSHMEM
  CudaIpc = 2,  // CUDA IPC on this host only: never NVSHMEM
};

// Who serves the collectives FSDP does not issue (all-reduce, broadcast, ...; ODC_SELF_SERVE).
enum class SelfServe : int {
  Inner = 0,  // the inner gloo / NCCL backend
  Odc = 1,    // odc itself, CPU and CUDA
  Auto = 2,   // odc for CUDA tensors when ranks share a GPU or NCCL is absent, or when small
              // (kSelfServeBytes) where every rank has a GPU of its own; else the inner
};
// ODC_SELF_SERVE=auto with a GPU per rank: odc serves a collective FSDP does not issue itself
// up to this many bytes per rank (the same on every rank), so that a group makes no NCCL group
// for a scalar (842 MiB per GPU on 2 x H200). Measured there, odc's own latency against
// NCCL's: all-reduce 0.85-0.89x from 4 KiB to 1 MiB (1.73x for one fp32: 63 against 37 us),
// 1.43x at 16 MiB; broadcast 0.53-0.70x from 4 B to 64 MiB.
constexpr size_t kSelfServeBytes = size_t{1} << 20;

// Ring defaults; Python sizes NVSHMEM's slab from them before any group exists.
constexpr size_t kDefaultChunkCpu = 1 << 20;
constexpr size_t kDefaultChunkCuda = 32 << 20;
constexpr int kDefaultSlots = 4;
// Registered memory: the most a pool may grow to (host shared memory is often small in
// containers), and the least it grows by.
constexpr size_t kDefaultPoolCpu = size_t{64} << 20;
constexpr size_t kDefaultPoolCuda = size_t{8} << 30;
constexpr size_t kPoolStepCpu = size_t{4} << 20;
constexpr size_t kPoolStepCuda = size_t{64} << 20;

struct Options final : c10d::Backend::Options {
  explicit Options(std::chrono::milliseconds timeout = ::kBackendDefaultTimeout)
      : c10d::Backend::Options("odc", timeout) {}

  static c10::intrusive_ptr<Options> create(
      std::chrono::milliseconds timeout = ::kBackendDefaultTimeout) {
    return c10::make_intrusive<Options>(timeout);
  }
  // A copy with every odc field. Declared as c10d's virtual Backend::Options::clone (torch >=
  // 2.14), which it then overrides (c10d's split clones the options it hands a child backend,
  // and would fall back to sharing a sliced copy); before 2.14 a plain member of this class.
  c10::intrusive_ptr<c10d::Backend::Options> clone() const { return copy(); }
  c10::intrusive_ptr<Options> copy() const { return c10::make_intrusive<Options>(*this); }

  size_t chunk_bytes = 0;         // ODC_CHUNK_BYTES: bytes per ring slot; 0: per device (above)
  int ring_slots = kDefaultSlots; // ODC_RING_SLOTS: ring depth per channel
  int reduce_blocks = 16;         // ODC_REDUCE_BLOCKS: CUDA blocks of the owner-side reduction
  int accumulate_blocks = 16;     // ODC_ACCUMULATE_BLOCKS: per peer, decoupled put-accumulate
  size_t small_op_bytes = 8 << 20;  // ODC_SMALL_OP_BYTES: largest copy of a fused op (0: none)
  int fused_blocks = 32;          // ODC_FUSED_BLOCKS: most CUDA blocks of one fused op
  bool stream_memops = false;     // ODC_STREAM_MEMOPS: CUDA waits/signals as stream memory ops
  int ag_push = -1;  // ODC_AG_PUSH: zero-copy all-gathers push shards (1), get them (0), auto (-1)
  // Whether a group's zero-copy all-gathers push (ODC_AG_PUSH; auto: 3 ranks or more, each
  // on a GPU of its own of this host, none routed). `own_gpus`: every rank of the group has a
  // GPU of its own on this host and no peer is routed. The same on every rank (the places
  // are the group's, and every rank routes by the same knobs).
  bool pushes_all_gathers(int ranks, bool own_gpus) const {
    return ag_push == 1 || (ag_push < 0 && ranks >= 3 && own_gpus);
  }
  // ODC_STAGED_AG_PUSH: all-gathers on the staged path put each chunk into the peers'
  // landing rings (an exchange) instead of letting them get it from this rank's
  // all-gather ring
  bool staged_ag_push = false;
  // ODC_ZERO_COPY: all-gathers and reduce-scatters of CUDA tensors from anywhere (the caching
  // allocator's included) read each rank's input where it lies, once every peer has mapped its
  // segment (Protocol::all_gather_direct); off: through the rings (the staged path)
  bool zero_copy = true;
  TransportKind transport = TransportKind::Auto;  // ODC_TRANSPORT
  int host_size = 0;  // ODC_HOST_SIZE: global ranks per host (g, h on one iff g / n == h / n)
  bool match_check = true;  // ODC_MATCH_CHECK: peers check each collective's descriptor
  SelfServe self_serve = SelfServe::Auto;  // ODC_SELF_SERVE
  bool nccl_available = true;  // whether torch has NCCL (SelfServe::Auto serves CUDA without)
  // ODC_NVSHMEM_STAGE=always: routed copies stage their local side to every routed peer, not
  // only to network peers (runs the network path where NVSHMEM maps every peer)
  bool nvshmem_stage_always = false;
  // ODC_POOL_BYTES: the most registered memory per rank behind allocate_tensor (pool.hpp),
  // which grows to what the buffers in use at once need; 0: per device (kDefaultPool*)
  size_t pool_bytes = 0;
  size_t pool_bytes_for(bool cuda) const {
    return pool_bytes ? pool_bytes : (cuda ? kDefaultPoolCuda : kDefaultPoolCpu);
  }

  size_t chunk_bytes_for(bool cuda) const {
    return chunk_bytes ? chunk_bytes : (cuda ? kDefaultChunkCuda : kDefaultChunkCpu);
  }
  // Whether ODC_HOST_SIZE puts these two global ranks on different hosts (ranks on hosts of
  // different names are on different hosts whatever it says: the channel compares names).
  bool splits_hosts(int64_t global_a, int64_t global_b) const {
    return host_size > 0 && global_a / host_size != global_b / host_size;
  }
  // The routing decision, for the channel and for Python (NVSHMEM set-up, decoupled mode):
  // whether CUDA traffic between these two global ranks goes over NVSHMEM.
  bool routes_peer(int64_t global_a, int64_t global_b) const {
    if (global_a == global_b || transport == TransportKind::CudaIpc) return false;
    return transport == TransportKind::Nvshmem ||
           (kBuiltWithNvshmem && splits_hosts(global_a, global_b));
  }
  bool routes_some_peer(const std::vector<int64_t>& global_ranks) const {
    // Routing splits ranks into classes (hosts; with Nvshmem, each rank its own): some pair
    // is routed iff some rank is routed from the first.
    for (int64_t b : global_ranks) {
      if (routes_peer(global_ranks.front(), b)) return true;
    }
    return false;
  }
  // Whether a group of these global ranks puts its CUDA windows in NVSHMEM's heap (every
  // peer routed with TransportKind::Nvshmem, even in a group of one).
  bool uses_nvshmem(const std::vector<int64_t>& global_ranks) const {
    return transport == TransportKind::Nvshmem || routes_some_peer(global_ranks);
  }
};

}  // namespace odc
