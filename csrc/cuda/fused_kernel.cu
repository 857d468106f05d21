// Layer 2, a transport's kernels (kernels.cuh): the fused kernel, a whole collective in one
// launch, its lanes on blocks of their own; launched through the driver where it can be.
#include "device_common.cuh"

namespace odc {
namespace {

// ---- The fused kernel (a collective in one launch; kernels.cuh, FusedOp).

// dst[begin, end) = scale * sum_j src[j][begin, end) with the whole block, fp32 in source
// order (as reduce_kernel). begin is a multiple of 8 elements (of 16 bytes for the 2-byte types).
template <typename T>
__device__ void block_reduce(void* dst_v, const void* const* srcs, int n_src, size_t begin,
                             size_t end, float scale) {
  constexpr int V = 16 / sizeof(T);
  union U { uint4 raw; T e[V]; };
  uintptr_t mis = reinterpret_cast<uintptr_t>(dst_v);
  for (int j = 0; j < n_src; ++j) mis |= reinterpret_cast<uintptr_t>(srcs[j]);
  const size_t vec_end = mis % 16 == 0 ? end / V : begin / V;
  for (size_t i = begin / V + threadIdx.x; i < vec_end; i += blockDim.x) {
    float acc[V];
    U u;
    u.raw = static_cast<const uint4*>(srcs[0])[i];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = to_f<T>(u.e[k]);
    for (int j = 1; j < n_src; ++j) {
      u.raw = static_cast<const uint4*>(srcs[j])[i];
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] += to_f<T>(u.e[k]);
    }
#pragma unroll
    for (int k = 0; k < V; ++k) u.e[k] = from_f<T>(acc[k] * scale);
    static_cast<uint4*>(dst_v)[i] = u.raw;
  }
  // From begin at least: an empty slice at the end (begin == end == numel) must not redo the
  // vectors' tail, which an in-place reduction (dst one of the sources) would add twice.
  for (size_t i = max(vec_end * V, begin) + threadIdx.x; i < end; i += blockDim.x) {
    float acc = to_f<T>(static_cast<const T*>(srcs[0])[i]);
    for (int j = 1; j < n_src; ++j) acc += to_f<T>(static_cast<const T*>(srcs[j])[i]);
    static_cast<T*>(dst_v)[i] = from_f<T>(acc * scale);
  }
}

// The last of a lane's `parts` blocks to arrive at its signal point `point` returns true
// (one thread per block calls it, after a __syncthreads). Release / acquire at GPU scope:
// what every arrived block did is ordered before the last one's later stores, and so
// (cumulativity) before the counters it signals after its system-scope fence.
__device__ __forceinline__ bool last_to_arrive(unsigned* counter, int parts) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
  if (old + 1 != static_cast<unsigned>(parts)) return false;
  *counter = 0;  // left zeroed for the ring's next operation (kernel boundaries order it)
  return true;
}

// Steps every block of a lane must have finished before the lane's next signal point: its copies
// and reductions, and checked waits (a block still reading a peer's descriptor must not let the
// peer overwrite it).
__device__ __forceinline__ bool needs_all_blocks(const FusedStep& s) {
  return s.kind == kStepCopy || s.kind == kStepReduce || s.kind == kStepCopyLocated ||
         s.kind == kStepReduceLocated || s.kind == kStepPushLocated ||
         (s.kind == kStepWait && s.check.desc != 0);
}

// A signal point of a lane: the run of stores (payloads, first: FusedEngine::lane_order puts them so) and
// signals from step i; returns where the run ends. One thread stores the payloads, fences
// once, and stores the counters: where the lane moved data (or checked a descriptor) since
// its last point, that of the last block to arrive (after every block's steps), which becomes
// the lane's leader; else the leader's. Then the others leave (`leave`, shared) if no such
// step is left to them: a block never waits on peers for nothing, so blocks not resident yet
// (SMs taken by other kernels) get to run.
__device__ __forceinline__ int signal_point(const FusedOp& op, int lane, int i, int parts,
                                            int point, bool& lead, int& leave) {
  const int lane_end = op.lane_begin[lane + 1];
  int end = i;
  while (end < lane_end && (op.steps[end].kind == kStepStore || op.steps[end].kind == kStepSignal)) ++end;
  bool data_before = false, data_after = false;
  for (int k = i - 1; k >= op.lane_begin[lane] && !(op.steps[k].kind == kStepStore ||
                                                    op.steps[k].kind == kStepSignal); --k) {
    data_before = data_before || needs_all_blocks(op.steps[k]);
  }
  for (int k = end; k < lane_end; ++k) data_after = data_after || needs_all_blocks(op.steps[k]);
  __syncthreads();
  if (threadIdx.x == 0) {
    if (parts > 1 && data_before) lead = last_to_arrive(op.arrivals + lane * kFusedMaxSteps + point, parts);
    leave = !lead && !data_after;
    if (lead) {
      bool fenced = false;
      for (int k = i; k < end; ++k) {
        const FusedStep& t = op.steps[k];
        if (t.kind == kStepSignal && !fenced) {
          fence_release();
          fenced = true;
        }
        for (int j = 0; j < t.n; ++j) {
          store_relaxed(static_cast<uint64_t*>(const_cast<void*>(op.ptrs[t.first + j])), t.value);
        }
      }
    }
  }
  __syncthreads();
  return end;
}

// This block's part of a reduction step (sums of fp32 / bf16 / fp16 only: FusedEngine::fits).
__device__ __forceinline__ void reduce_step(const FusedStep& s, const void* const* srcs, int part,
                                            int parts) {
  const float scale = s.scale_ptr ? *s.scale_ptr : s.scale;
  size_t b, e;  // multiples of 8 elements: 16-byte vectors of every fused dtype
  slice_of(s.value, 8, part, parts, &b, &e);
  switch (static_cast<DType>(s.dtype)) {
    case DType::F32: block_reduce<float>(s.dst, srcs, s.n, b, e, scale); break;
    case DType::BF16: block_reduce<__nv_bfloat16>(s.dst, srcs, s.n, b, e, scale); break;
    case DType::F16: block_reduce<__half>(s.dst, srcs, s.n, b, e, scale); break;
    default: break;
  }
}

// Source j of a located step (kernels.cuh, StepKind), or null (recorded).
__device__ const void* located_source(const FusedOp& op, const FusedStep& s, int j) {
  const bool copy = s.kind == kStepCopyLocated;
  const int k = s.first + j;
  const uint64_t* where = copy ? s.located.where : static_cast<const uint64_t*>(op.ptrs[k + s.n]);
  const char* staged = static_cast<const char*>(copy ? s.src : op.ptrs[k]);
  // (fused reductions are of fp32, bf16 or fp16 only: FusedEngine::fits)
  const unsigned long long len = copy ? s.value : s.value * (static_cast<DType>(s.dtype) == DType::F32 ? 4 : 2);
  return where ? resolve_located(where, copy ? s.owner : j, staged, s.located.offset, len, op.segments, op.err,
                                 op.op_seq, op.op, false, op.watch_slots ? op.watch_word : 0)
               : staged;
}

// This block's part of a push: the destination from its owner's word (thread 0, into `to`, a
// shared slot); nothing where the word says the owner reads for itself. False where it failed.
__device__ bool push_step(const FusedOp& op, const FusedStep& s, int part, int parts,
                          const void*& to, int& failed) {
  if (threadIdx.x == 0) {
    bool unmapped = false;
    to = resolve_located(s.located.where, s.owner, nullptr, s.located.offset, s.value, op.segments,
                         op.err, op.op_seq, op.op, false, op.watch_slots ? op.watch_word : 0, &unmapped);
    if (!to && !unmapped) failed = 1;
  }
  __syncthreads();
  if (failed) return false;
  if (to) {
    size_t b, e;
    slice_of(s.value, 16, part, parts, &b, &e);
    block_copy(static_cast<char*>(const_cast<void*>(to)) + b, static_cast<const char*>(s.src) + b, e - b);
  }
  __syncthreads();  // every thread is done with `to` before a next step refills it
  return true;
}

__global__ void __launch_bounds__(kFusedThreads) fused_kernel(const __grid_constant__ FusedOp op) {
  __shared__ int failed, leave;
  __shared__ const void* located[kMaxPeers];  // a located step's sources, resolved
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  const uint64_t start = global_ns();
  int lane = 0;
  while (static_cast<int>(blockIdx.x) >= op.block_begin[lane + 1]) ++lane;
  const int part = blockIdx.x - op.block_begin[lane];
  const int parts = op.block_begin[lane + 1] - op.block_begin[lane];
  int point = 0;            // this lane's signal points so far
  bool lead = part == 0;    // (thread 0) the lane's leader: the last block at its last data point
  for (int i = op.lane_begin[lane]; i < op.lane_begin[lane + 1]; ++i) {
    const FusedStep& s = op.steps[i];
    switch (s.kind) {
      case kStepWait:  // every block of the lane waits (its later steps read what arrived)
        if (threadIdx.x < s.n) {
          const int k = s.first + threadIdx.x;
          if (!wait_counter(static_cast<const uint64_t*>(op.ptrs[k]), s.value, start,
                            op.timeout_ns, op.err, op.peers[k], op.op_seq, op.op, s.what,
                            PeerWatch{op.watch_slots, op.watch_word}) ||
              (s.check.desc && !check_desc(static_cast<const uint64_t*>(op.ptrs[k + s.n]),
                                           s.check.desc, s.check.id, op.err, op.peers[k], op.op_seq, op.op,
                                     op.watch_slots ? op.watch_word : 0))) {
            failed = 1;
          }
        }
        __syncthreads();
        if (failed) return;  // the error is recorded; later steps would read garbage
        break;
      case kStepStore:
      case kStepSignal:
        i = signal_point(op, lane, i, parts, point, lead, leave) - 1;
        if (leave) return;
        ++point;
        break;
      case kStepCopy: {
        size_t b, e;  // 16-byte units, so that every block's piece keeps the copy's alignment
        slice_of(s.value, 16, part, parts, &b, &e);
        block_copy(static_cast<char*>(s.dst) + b, static_cast<const char*>(s.src) + b, e - b);
        __syncthreads();
        break;
      }
      case kStepReduce:
        reduce_step(s, op.ptrs + s.first, part, parts);
        __syncthreads();  // a following copy or signal sees the whole result
        break;
      case kStepCopyLocated:
      case kStepReduceLocated: {  // the sources, from their owners' words (one thread each)
        const bool copy = s.kind == kStepCopyLocated;
        if (threadIdx.x < (copy ? 1 : s.n) && !(located[threadIdx.x] = located_source(op, s, threadIdx.x))) {
          failed = 1;
        }
        __syncthreads();
        if (failed) return;  // recorded; nothing is read
        if (copy) {
          size_t b, e;
          slice_of(s.value, 16, part, parts, &b, &e);
          block_copy(static_cast<char*>(s.dst) + b, static_cast<const char*>(located[0]) + b, e - b);
        } else {
          reduce_step(s, located, part, parts);
        }
        __syncthreads();  // every thread is done with `located` before a next step refills it
        break;
      }
      case kStepPushLocated:
        if (!push_step(op, s, part, parts, located[0], failed)) return;  // recorded; nothing written
        break;
      default:  // accumulate / zero steps are never fused
        break;
    }
  }
}

}  // namespace

namespace {
// The fused kernel is launched through the driver (cuLaunchKernel): about 0.3-0.5 us less host
// time per call than the runtime's launch (H100, with and without MPS), and a small collective
// costs little more than its launch. The function handle belongs to a device's context:
// preload_kernels resolves it for each device it sets up; a device without one (or a driver
// without the entry point) takes the runtime's launch.
using CuLaunchKernel = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    unsigned, unsigned, CUstream, void**, void**);
constexpr int kMaxDevices = 64;
std::atomic<CuLaunchKernel> g_cu_launch{nullptr};
std::atomic<CUfunction> g_fused_fn[kMaxDevices] = {};
}  // namespace

void resolve_fused_launch(int device) {
  if (device < 0 || device >= kMaxDevices) return;
  if (!g_cu_launch.load()) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuLaunchKernel", &fn, 12000, cudaEnableDefault, &q) !=
            cudaSuccess || q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return;
    }
    g_cu_launch.store(reinterpret_cast<CuLaunchKernel>(fn));
  }
  cudaFunction_t f = nullptr;
  if (cudaGetFuncBySymbol(&f, reinterpret_cast<const void*>(fused_kernel)) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  g_fused_fn[device].store(reinterpret_cast<CUfunction>(f));
}

cudaError_t launch_fused(const FusedOp& op, int device, cudaStream_t stream) {
  const unsigned grid = op.block_begin[op.lanes];
  const CuLaunchKernel cu_launch = g_cu_launch.load(std::memory_order_relaxed);
  const CUfunction fn = device >= 0 && device < kMaxDevices
                            ? g_fused_fn[device].load(std::memory_order_relaxed)
                            : nullptr;
  if (cu_launch && fn) {
    void* params[] = {const_cast<FusedOp*>(&op)};
    const CUresult r = cu_launch(fn, grid, 1, 1, kFusedThreads, 1, 1, 0,
                                 reinterpret_cast<CUstream>(stream), params, nullptr);
    // The runtime's error codes have the driver's values (invalid handle 400, launch out of
    // resources 701, launch failed 719, ...).
    return static_cast<cudaError_t>(r);
  }
  fused_kernel<<<grid, kFusedThreads, 0, stream>>>(op);
  return cudaGetLastError();
}


cudaError_t preload_fused_kernel() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, fused_kernel);
}

}  // namespace odc
