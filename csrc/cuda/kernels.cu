// Layer 2, a transport's kernels (kernels.cuh).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "kernels.cuh"

namespace odc {
namespace {

__device__ __forceinline__ uint64_t load_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_relaxed(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Orders everything before it (this thread's accesses, and by cumulativity what it has
// observed: earlier work on the stream, the block's steps before a __syncthreads) before
// this thread's later stores. One MEMBAR.ALL.SYS: a signal point costs one fence, not one
// per store (__threadfence_system is the costlier sequentially consistent MEMBAR.SC.SYS).
__device__ __forceinline__ void fence_release() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The group's first failure wins: fill the record, then publish its code (the host reads
// the fields once it sees the code). 1: a wait timed out, 2: a descriptor mismatch, 3: a
// peer announced another collective (kernels.cuh, DeviceError).
__device__ void record_error(DeviceError* err_ptr, int code, int peer, unsigned long long op_seq,
                             const char* op, const char* what, unsigned long long mine,
                             unsigned long long theirs, unsigned long long target,
                             unsigned long long seen) {
  volatile DeviceError* err = err_ptr;
  if (err->code != 0) return;
  err->peer = peer;
  err->op_seq = op_seq;
  err->mine = mine;
  err->theirs = theirs;
  err->target = target;
  err->seen = seen;
  err->op = op;
  err->what = what;
  __threadfence_system();
  err->code = code;
  __threadfence_system();
}

// Spin until *flag >= target. Returns false when the wait timed out (recorded in
// err) or the group already failed (err->code set by another wait).
// With watch.slots, also fail (code 3) as soon as the peer announced another collective
// under the number of this rank's announcement (PeerWatch, layout.hpp).
__device__ bool wait_counter(const uint64_t* flag, uint64_t target, uint64_t start,
                             unsigned long long timeout_ns, DeviceError* err_ptr, int peer,
                             unsigned long long op_seq, const char* op, const char* what,
                             const PeerWatch& watch) {
  volatile DeviceError* err = err_ptr;
  uint64_t seen;
  uint32_t iter = 0;
  const uint64_t* watched = watch.slots ? watch.slot_of(peer) : nullptr;
  while ((seen = load_acquire(flag)) < target) {
    if ((++iter & 1023u) != 0) continue;
    if (err->code != 0) return false;  // the group already failed: drain the stream quickly
    if (watched) {
      const uint64_t theirs = load_acquire(watched);
      if (watch.differs(theirs)) {
        record_error(err_ptr, 3, peer, op_seq, op, what, watch.word, theirs, 0, 0);
        return false;
      }
    }
    if (global_ns() - start > timeout_ns) {
      record_error(err_ptr, 1, peer, op_seq, op, what, 0, 0, target, seen);
      return false;
    }
  }
  return true;
}

// After wait_counter saw the peer's counter reached (the same thread: its acquire orders
// these reads after the peer's stores): false, with the mismatch recorded in err, when the
// descriptor the peer stored with it differs from this rank's or came with another id (the
// chunk's number, or a registered collective's RegisteredId).
__device__ bool check_desc(const uint64_t* desc, unsigned long long expected,
                           unsigned long long chunk, DeviceError* err_ptr, int peer,
                           unsigned long long op_seq, const char* op) {
  const volatile uint64_t* d = reinterpret_cast<const volatile uint64_t*>(desc);
  const unsigned long long theirs = d[0], their_chunk = d[1];
  if (theirs == expected && their_chunk == chunk) return true;
  record_error(err_ptr, 2, peer, op_seq, op, nullptr, expected, theirs, chunk, their_chunk);
  return false;
}

__global__ void flag_kernel(FlagOp op) {
  const int t = threadIdx.x;
  if (t == 0) {  // one thread: the payloads, one fence, then the counters (FlagOp)
    bool fenced = false;
    for (int pass = 0; pass < 2; ++pass) {
      for (int b = 0; b < kSignalBatches; ++b) {
        if (op.n_signal[b] == 0 || op.payload[b] != (pass == 0)) continue;
        if (pass == 1 && !fenced) {
          fence_release();
          fenced = true;
        }
        for (int i = 0; i < op.n_signal[b]; ++i) store_relaxed(op.signal[b][i], op.signal_value[b]);
      }
    }
  }
  if (op.n_wait == 0) return;
  const uint64_t start = global_ns();
  for (int i = t; i < op.n_wait; i += blockDim.x) {
    if (!wait_counter(op.wait[i], op.wait_target, start, op.timeout_ns, op.err, op.wait_peer[i],
                      op.op_seq, op.op, op.what, PeerWatch{op.watch_slots, op.watch_word})) {
      return;
    }
    if (op.desc_expected && !check_desc(op.desc[i], op.desc_expected, op.desc_id, op.err,
                                        op.wait_peer[i], op.op_seq, op.op)) {
      return;
    }
  }
}

__global__ void gate_kernel(const __grid_constant__ GateOp g) {
  __shared__ int failed;
  volatile DeviceError* err = g.err;
  if (threadIdx.x == 0) failed = err->code != 0;  // the group failed: nothing more into peers' memory
  __syncthreads();
  if (failed) return;
  const uint64_t start = global_ns();
  for (int i = threadIdx.x; i < g.n; i += blockDim.x) {
    if (!wait_counter(g.flag[i], g.target, start, g.timeout_ns, g.err, g.peer[i], g.op_seq, g.op,
                      g.what, PeerWatch{g.watch_slots, g.watch_word}) ||
        (g.desc_expected && !check_desc(g.desc[i], g.desc_expected, g.desc_id, g.err, g.peer[i],
                                        g.op_seq, g.op))) {
      failed = 1;
    }
  }
  __syncthreads();
  if (failed || threadIdx.x != 0 || err->code != 0) return;
  for (int i = 0; i < g.n; ++i) g.go[i] = g.target;  // ordered before the graph's next nodes
  cudaGraphSetConditional(g.cond, 1);
}

__global__ void put_signal_kernel(const __grid_constant__ PutSignalOp p) {
  if (threadIdx.x != 0) return;
  fence_release();  // the copies (complete: graph order) before the counters, as a flag kernel
  for (int i = 0; i < p.n; ++i) store_relaxed(p.done[i], p.go[i]);
}

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <> __device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }

// Accumulation type of a reduction: fp32 for the 16/32-bit floats, fp64 for float64,
// int64 for integers (protocol.hpp, ReduceSpec).
template <typename T> struct AccOf { using type = long long; };
template <> struct AccOf<float> { using type = float; };
template <> struct AccOf<__nv_bfloat16> { using type = float; };
template <> struct AccOf<__half> { using type = float; };
template <> struct AccOf<double> { using type = double; };

template <typename T, typename A> __device__ __forceinline__ A to_acc(T v) { return static_cast<A>(v); }
template <> __device__ __forceinline__ float to_acc<__nv_bfloat16, float>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <> __device__ __forceinline__ float to_acc<__half, float>(__half v) { return __half2float(v); }
template <typename T, typename A> __device__ __forceinline__ T from_acc(A v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16, float>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_acc<__half, float>(float v) { return __float2half_rn(v); }

template <Combine C, typename A>
__device__ __forceinline__ A combine(A a, A b) {
  if constexpr (C == Combine::Sum) {
    return a + b;
  } else if constexpr (C == Combine::Product) {
    return a * b;
  } else {
    if (a != a) return a;  // NaN wins
    if (b != b) return b;
    return C == Combine::Max ? (b > a ? b : a) : (b < a ? b : a);
  }
}

// The vectors from `from_vec` on, then (when unaligned) the elements: one per thread,
// strided by the grid, in source order (the two reduce kernels' remainders).
template <typename T, Combine C>
__device__ __forceinline__ void reduce_rest(const ReduceOpArgs& a, size_t from_vec, size_t tid,
                                            size_t threads, typename AccOf<T>::type scale, bool scaled) {
  using A = typename AccOf<T>::type;
  constexpr int V = 16 / sizeof(T);
  union U { uint4 raw; T e[V]; };
  const size_t nvec = a.vectorized ? a.numel / V : 0;
  const uint4* const* src = reinterpret_cast<const uint4* const*>(a.src);
  uint4* dst = static_cast<uint4*>(a.dst);
  auto finish = [&](A v) { return from_acc<T, A>(scaled ? static_cast<A>(v * scale) : v); };
  for (size_t i = from_vec + tid; i < nvec; i += threads) {  // the vectors left over
    A acc[V];
    U u;
    u.raw = src[0][i];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = to_acc<T, A>(u.e[k]);
    for (int j = 1; j < a.n_src; ++j) {
      u.raw = src[j][i];
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] = combine<C>(acc[k], to_acc<T, A>(u.e[k]));
    }
#pragma unroll
    for (int k = 0; k < V; ++k) u.e[k] = finish(acc[k]);
    dst[i] = u.raw;
  }
  for (size_t i = nvec * V + tid; i < a.numel; i += threads) {  // elements, when unaligned
    A acc = to_acc<T, A>(static_cast<const T*>(a.src[0])[i]);
    for (int j = 1; j < a.n_src; ++j) {
      acc = combine<C>(acc, to_acc<T, A>(static_cast<const T*>(a.src[j])[i]));
    }
    static_cast<T*>(a.dst)[i] = finish(acc);
  }
}

// out = combine_j src[j] in source (rank) order, in the accumulation type, times the scale
// for a scaled Sum. A few blocks must stream at HBM speed, so each thread keeps kUnroll
// 16-byte loads of every source in flight before it accumulates (memory-level
// parallelism instead of occupancy: the kernel shares the GPU with compute).
constexpr int kUnroll = 4;

constexpr int kReduceThreads = 512;

// Bounded registers: the 1-byte types keep kUnroll x 16 int64 accumulators per thread, which
// without the bound asked for more registers than 512 threads have ("too many resources
// requested for launch" on H100); the compiler spills there instead.
template <typename T, Combine C>
__global__ void __launch_bounds__(kReduceThreads) reduce_kernel(ReduceOpArgs a) {
  using A = typename AccOf<T>::type;
  const A scale = a.scale_ptr ? static_cast<A>(*a.scale_ptr) : static_cast<A>(a.scale);
  const bool scaled = C == Combine::Sum && (a.scale_ptr != nullptr || a.scale != 1.0);
  constexpr int V = 16 / sizeof(T);
  union U { uint4 raw; T e[V]; };
  const size_t threads = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nvec = a.vectorized ? a.numel / V : 0;
  const uint4* const* src = reinterpret_cast<const uint4* const*>(a.src);
  uint4* dst = static_cast<uint4*>(a.dst);
  auto finish = [&](A v) { return from_acc<T, A>(scaled ? static_cast<A>(v * scale) : v); };
  // Groups of kUnroll vectors, strided by the grid: vector (base + u * threads).
  const size_t full = nvec / (threads * kUnroll) * (threads * kUnroll);
  // Sources two at a time (one at a time for the 1-byte types, whose accumulators fill the
  // registers): both sources' loads are in flight together, which doubles what a block
  // streams; they are still combined in source order.
  constexpr int kGroup = sizeof(T) > 1 ? 2 : 1;
  for (size_t base = tid; base < full; base += threads * kUnroll) {
    A acc[kUnroll][V];
    U u[kGroup][kUnroll];
    for (int j = 0; j < a.n_src; j += kGroup) {
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (j + g < a.n_src) {
#pragma unroll
          for (int r = 0; r < kUnroll; ++r) u[g][r].raw = src[j + g][base + r * threads];
        }
      }
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (j + g >= a.n_src) break;
#pragma unroll
        for (int r = 0; r < kUnroll; ++r)
#pragma unroll
          for (int k = 0; k < V; ++k) {
            const A x = to_acc<T, A>(u[g][r].e[k]);
            acc[r][k] = j + g == 0 ? x : combine<C>(acc[r][k], x);
          }
      }
    }
#pragma unroll
    for (int r = 0; r < kUnroll; ++r) {
#pragma unroll
      for (int k = 0; k < V; ++k) u[0][r].e[k] = finish(acc[r][k]);
      dst[base + r * threads] = u[0][r].raw;
    }
  }
  reduce_rest<T, C>(a, full, tid, threads, scale, scaled);
}

// ---- The floating-point Sum (the gradients' reductions) through the TMA engine.
// One thread has the SM's bulk-copy (TMA) engine stream tiles of every source into shared
// memory, kPipeStages tiles ahead; the block sums them from there. Measured on H100 (bf16,
// 2 sources, one of them a peer's): a block of the register kernel reads across NVLink at
// about 51 GB/s (latency-bound), one of this kernel at about 69; from this GPU's own memory
// the register kernel is as fast or a little faster (73 against 68 GB/s, 2 to 8 sources), so
// the transport asks for this kernel only where sources lie on other GPUs. Same sums in the
// same order as reduce_kernel: bitwise equal results. Hopper (sm_90) and later.
constexpr int kPipeStages = 4;
constexpr int kPipeBytes = 192 * 1024;  // shared memory per block, at most (the device's opt-in)

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// A tile is `chunk` bytes of every source; tiles go to blocks round robin.
template <typename T>
__global__ void __launch_bounds__(kReduceThreads) reduce_bulk_kernel(ReduceOpArgs a, int chunk) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char tiles[];  // [stage][source][chunk]
  __shared__ __align__(8) unsigned long long landed[kPipeStages];  // an mbarrier per stage
  const float scale = a.scale_ptr ? *a.scale_ptr : static_cast<float>(a.scale);
  const bool scaled = a.scale_ptr != nullptr || a.scale != 1.0;
  constexpr int V = 16 / sizeof(T);
  union U { uint4 raw; T e[V]; };
  const int n = a.n_src;
  const size_t tile_vecs = chunk / 16;
  const size_t n_tiles = a.numel / V / tile_vecs;  // launched for vectorized inputs only
  const size_t mine = blockIdx.x < n_tiles ? (n_tiles - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  auto tile_of = [&](size_t i) { return blockIdx.x + i * gridDim.x; };
  auto slot = [&](size_t i, int j) {
    return reinterpret_cast<const uint4*>(tiles + (i % kPipeStages * n + j) * static_cast<size_t>(chunk));
  };
  // Thread 0: stage i's barrier expects n * chunk bytes, then one bulk copy per source.
  auto fetch = [&](size_t i) {
    const unsigned bar = smem_addr(&landed[i % kPipeStages]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(n * chunk)
                 : "memory");
    for (int j = 0; j < n; ++j) {
      const char* from = static_cast<const char*>(a.src[j]) + tile_of(i) * chunk;
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
              smem_addr(slot(i, j))),
          "l"(from), "r"(chunk), "r"(bar)
          : "memory");
    }
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kPipeStages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&landed[s])) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (size_t i = 0; i < kPipeStages && i < mine; ++i) fetch(i);
  }
  uint4* dst = static_cast<uint4*>(a.dst);
  for (size_t i = 0; i < mine; ++i) {
    const unsigned bar = smem_addr(&landed[i % kPipeStages]), parity = (i / kPipeStages) & 1;
    unsigned ready = 0;
    while (!ready) {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
          : "=r"(ready)
          : "r"(bar), "r"(parity)
          : "memory");
    }
    for (size_t v = threadIdx.x; v < tile_vecs; v += blockDim.x) {
      float acc[V];
      U u;
      u.raw = slot(i, 0)[v];
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] = to_f<T>(u.e[k]);
      for (int j = 1; j < n; ++j) {
        u.raw = slot(i, j)[v];
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] += to_f<T>(u.e[k]);
      }
#pragma unroll
      for (int k = 0; k < V; ++k) u.e[k] = from_f<T>(scaled ? acc[k] * scale : acc[k]);
      dst[tile_of(i) * tile_vecs + v] = u.raw;
    }
    __syncthreads();  // every thread is done with the stage: it may be refilled
    if (threadIdx.x == 0 && i + kPipeStages < mine) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // our reads before the engine's writes
      fetch(i + kPipeStages);
    }
  }
  reduce_rest<T, Combine::Sum>(a, n_tiles * tile_vecs, blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x,
                               static_cast<size_t>(gridDim.x) * blockDim.x, scale, scaled);
#endif
}

// ---- The fused kernel (a collective in one launch; kernels.cuh, FusedOp).

// Copy `bytes` with the whole block, in the widest unit both pointers allow.
template <typename U, int kUnrollCopy>
__device__ __forceinline__ void block_copy_units(char* dst, const char* src, size_t n_units) {
  const U* s = reinterpret_cast<const U*>(src);
  U* d = reinterpret_cast<U*>(dst);
  const size_t step = static_cast<size_t>(blockDim.x) * kUnrollCopy;
  size_t i = threadIdx.x;
  for (; i + (kUnrollCopy - 1) * blockDim.x < n_units; i += step) {
    U v[kUnrollCopy];
#pragma unroll
    for (int r = 0; r < kUnrollCopy; ++r) v[r] = s[i + r * blockDim.x];
#pragma unroll
    for (int r = 0; r < kUnrollCopy; ++r) d[i + r * blockDim.x] = v[r];
  }
  for (; i < n_units; i += blockDim.x) d[i] = s[i];
}

__device__ void block_copy(void* dst_v, const void* src_v, size_t bytes) {
  char* dst = static_cast<char*>(dst_v);
  const char* src = static_cast<const char*>(src_v);
  const uintptr_t mis = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  size_t done;
  if (mis % 16 == 0) {
    block_copy_units<uint4, 8>(dst, src, bytes / 16);
    done = bytes / 16 * 16;
  } else if (mis % 8 == 0) {
    block_copy_units<uint2, 8>(dst, src, bytes / 8);
    done = bytes / 8 * 8;
  } else if (mis % 4 == 0) {
    block_copy_units<uint32_t, 8>(dst, src, bytes / 4);
    done = bytes / 4 * 4;
  } else if (mis % 2 == 0) {
    block_copy_units<uint16_t, 8>(dst, src, bytes / 2);
    done = bytes / 2 * 2;
  } else {
    done = 0;
  }
  for (size_t i = done + threadIdx.x; i < bytes; i += blockDim.x) dst[i] = src[i];
}

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

// [begin, end) of `units` units, part `part` of `parts`: whole multiples of `align` units.
__device__ __forceinline__ void slice_of(size_t units, size_t align, int part, int parts,
                                         size_t* begin, size_t* end) {
  const size_t per = ((units + align - 1) / align + parts - 1) / parts * align;
  *begin = min(units, per * part);
  *end = min(units, *begin + per);
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
  return s.kind == kStepCopy || s.kind == kStepReduce || (s.kind == kStepWait && s.desc != 0);
}

__global__ void __launch_bounds__(kFusedThreads) fused_kernel(const __grid_constant__ FusedOp op) {
  __shared__ int failed, leave;
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
              (s.desc && !check_desc(static_cast<const uint64_t*>(op.ptrs[k + s.n]), s.desc,
                                     s.desc_id, op.err, op.peers[k], op.op_seq, op.op))) {
            failed = 1;
          }
        }
        __syncthreads();
        if (failed) return;  // the error is recorded; later steps would read garbage
        break;
      case kStepStore:
      case kStepSignal: {
        // A signal point: the run of stores (payloads, first: run_fused orders them so) and
        // signals from here. One thread stores the payloads, fences once, and stores the
        // counters: where the lane moved data (or checked a descriptor) since its last point,
        // that of the last block to arrive (after every block's steps), which becomes the lane's
        // leader; else the leader's. Then the others leave if no such step is left to them: a
        // block never waits on peers for nothing, so blocks not resident yet (SMs taken by other
        // kernels) get to run.
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
        if (leave) return;
        ++point;
        i = end - 1;
        break;
      }
      case kStepCopy: {
        size_t b, e;  // 16-byte units, so that every block's piece keeps the copy's alignment
        slice_of(s.value, 16, part, parts, &b, &e);
        block_copy(static_cast<char*>(s.dst) + b, static_cast<const char*>(s.src) + b, e - b);
        __syncthreads();
        break;
      }
      case kStepReduce: {
        const float scale = s.scale_ptr ? *s.scale_ptr : s.scale;
        const void* const* srcs = op.ptrs + s.first;
        size_t b, e;  // multiples of 8 elements: 16-byte vectors of every fused dtype
        slice_of(s.value, 8, part, parts, &b, &e);
        switch (static_cast<DType>(s.dtype)) {  // fused: sums of these only (fusable())
          case DType::F32: block_reduce<float>(s.dst, srcs, s.n, b, e, scale); break;
          case DType::BF16: block_reduce<__nv_bfloat16>(s.dst, srcs, s.n, b, e, scale); break;
          case DType::F16: block_reduce<__half>(s.dst, srcs, s.n, b, e, scale); break;
          default: break;
        }
        __syncthreads();  // a following copy or signal sees the whole result
        break;
      }
      default:  // accumulate / zero steps are never fused
        break;
    }
  }
}

template <typename T>
__global__ void accumulate_kernel(float* dst, const T* src, size_t numel) {
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t done = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Hopper has 16-byte float atomics: one NVLink transaction adds 4 floats (each element
  // atomic on its own, which is all accumulation needs) instead of four.
  if ((reinterpret_cast<uintptr_t>(dst) % 16) == 0 && (reinterpret_cast<uintptr_t>(src) % (4 * sizeof(T))) == 0) {
    const size_t vectors = numel / 4;
    float4* dst4 = reinterpret_cast<float4*>(dst);
    for (size_t v = first; v < vectors; v += stride) {
      float4 x;
      if constexpr (std::is_same<T, float>::value) {
        x = reinterpret_cast<const float4*>(src)[v];
      } else {
        const T* s = src + 4 * v;
        x = make_float4(to_f<T>(s[0]), to_f<T>(s[1]), to_f<T>(s[2]), to_f<T>(s[3]));
      }
      atomicAdd_system(dst4 + v, x);
    }
    done = vectors * 4;
  }
#endif
  for (size_t i = done + first; i < numel; i += stride) {
    atomicAdd_system(dst + i, to_f<T>(src[i]));
  }
}

}  // namespace

cudaError_t launch_accumulate(float* dst, const void* src, size_t numel, DType dtype, int blocks,
                              cudaStream_t stream) {
  constexpr int kThreads = 512;
  const int needed = static_cast<int>((numel + kThreads - 1) / kThreads);
  const int grid = needed < blocks ? (needed > 0 ? needed : 1) : blocks;
  switch (dtype) {
    case DType::F32:
      accumulate_kernel<float><<<grid, kThreads, 0, stream>>>(dst, static_cast<const float*>(src), numel);
      break;
    case DType::BF16:
      accumulate_kernel<__nv_bfloat16>
          <<<grid, kThreads, 0, stream>>>(dst, static_cast<const __nv_bfloat16*>(src), numel);
      break;
    case DType::F16:
      accumulate_kernel<__half><<<grid, kThreads, 0, stream>>>(dst, static_cast<const __half*>(src), numel);
      break;
    default:
      return cudaErrorInvalidValue;  // decoupled mode reduces in fp32 / bf16 / fp16 only
  }
  return cudaGetLastError();
}

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
}  // namespace

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

namespace {
// One block of 32 threads running `fn` with args = {&its one parameter}.
cudaKernelNodeParams one_warp_node(void* fn, void** args) {
  cudaKernelNodeParams p{};
  p.func = fn;
  p.gridDim = dim3(1);
  p.blockDim = dim3(32);
  p.sharedMemBytes = 0;
  p.kernelParams = args;
  p.extra = nullptr;
  return p;
}
}  // namespace

cudaKernelNodeParams gate_node_params(void** args) {
  return one_warp_node(reinterpret_cast<void*>(&gate_kernel), args);
}

cudaKernelNodeParams put_signal_node_params(void** args) {
  return one_warp_node(reinterpret_cast<void*>(&put_signal_kernel), args);
}

cudaError_t launch_flag_op(const FlagOp& op, cudaStream_t stream) {
  flag_kernel<<<1, 32, 0, stream>>>(op);
  return cudaGetLastError();
}

namespace {
// The reduce kernel of (dtype, combine): its address, for a launch or a module load.
template <typename T>
const void* reduce_kernel_of(Combine c) {
  switch (c) {
    case Combine::Sum: return reinterpret_cast<const void*>(reduce_kernel<T, Combine::Sum>);
    case Combine::Max: return reinterpret_cast<const void*>(reduce_kernel<T, Combine::Max>);
    case Combine::Min: return reinterpret_cast<const void*>(reduce_kernel<T, Combine::Min>);
    case Combine::Product: return reinterpret_cast<const void*>(reduce_kernel<T, Combine::Product>);
  }
  return nullptr;
}

const void* reduce_kernel_of(DType d, Combine c) {
  switch (d) {
    case DType::F32: return reduce_kernel_of<float>(c);
    case DType::BF16: return reduce_kernel_of<__nv_bfloat16>(c);
    case DType::F16: return reduce_kernel_of<__half>(c);
    case DType::F64: return reduce_kernel_of<double>(c);
    case DType::I32: return reduce_kernel_of<int32_t>(c);
    case DType::I64: return reduce_kernel_of<int64_t>(c);
    case DType::U8: return reduce_kernel_of<uint8_t>(c);
    case DType::I8: return reduce_kernel_of<int8_t>(c);
  }
  return nullptr;
}

const void* bulk_kernel_of(DType d) {
  switch (d) {
    case DType::F32: return reinterpret_cast<const void*>(reduce_bulk_kernel<float>);
    case DType::BF16: return reinterpret_cast<const void*>(reduce_bulk_kernel<__nv_bfloat16>);
    case DType::F16: return reinterpret_cast<const void*>(reduce_bulk_kernel<__half>);
    default: return nullptr;
  }
}

// Shared memory per block the bulk reductions may use on every device this process set up
// (-1: none yet; 0: a device before Hopper, so not at all).
std::atomic<int> g_bulk_smem{-1};

struct BulkReduce {
  const void* kernel = nullptr;  // null: the register kernel serves
  int chunk = 0;                 // bytes of each source per tile
  size_t smem_bytes = 0;
};

// The bulk kernel for a floating-point Sum of aligned inputs, with kPipeStages tiles of
// every source in shared memory; null where a source's tile would be under 1 KiB.
BulkReduce bulk_reduce(const ReduceOpArgs& a, DType d, Combine c) {
  BulkReduce p;
  const int smem = g_bulk_smem.load(std::memory_order_relaxed);
  const void* kernel = bulk_kernel_of(d);
  if (c != Combine::Sum || !a.vectorized || a.n_src < 1 || smem <= 0 || !kernel) return p;
  const int chunk = smem / (kPipeStages * a.n_src) / 16 * 16;
  if (chunk < 1024) return p;
  p.kernel = kernel;
  p.chunk = chunk;
  p.smem_bytes = static_cast<size_t>(chunk) * kPipeStages * a.n_src;
  return p;
}
}  // namespace

cudaError_t preload_kernels() {
  cudaFuncAttributes attr;
  cudaError_t e = cudaFuncGetAttributes(&attr, flag_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, fused_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, accumulate_kernel<float>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, accumulate_kernel<__nv_bfloat16>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, accumulate_kernel<__half>);
  for (int d = 0; d <= static_cast<int>(DType::I8) && e == cudaSuccess; ++d) {
    for (int c = 0; c <= static_cast<int>(Combine::Product) && e == cudaSuccess; ++c) {
      e = cudaFuncGetAttributes(&attr, reduce_kernel_of(static_cast<DType>(d), static_cast<Combine>(c)));
    }
  }
  // The bulk reductions (Hopper and later) take up to kPipeBytes of shared memory per block.
  int device = 0, major = 0, optin = 0;
  if (e == cudaSuccess) e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  const int smem = major >= 9 ? std::min(kPipeBytes, optin - 1024) : 0;  // 1 KiB: the static barriers
  for (DType d : {DType::F32, DType::BF16, DType::F16}) {
    if (e == cudaSuccess && smem > 0) {
      e = cudaFuncSetAttribute(bulk_kernel_of(d), cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    }
  }
  if (e == cudaSuccess) resolve_fused_launch(device);
  if (e == cudaSuccess) {  // the least of the devices this process set up
    int seen = g_bulk_smem.load();
    while ((seen < 0 || smem < seen) && !g_bulk_smem.compare_exchange_weak(seen, smem)) {
    }
  }
  return e;
}

int reduce_grid(size_t numel, int blocks) {
  const size_t per_block = static_cast<size_t>(kReduceThreads) * 8 * kUnroll;
  const size_t needed = (numel + per_block - 1) / per_block;
  return static_cast<int>(std::clamp<size_t>(needed, 1, static_cast<size_t>(blocks)));
}

cudaError_t launch_reduce(const ReduceOpArgs& args, DType dtype, Combine combine, int blocks,
                          bool bulk, cudaStream_t stream) {
  constexpr int kThreads = kReduceThreads;
  const int grid = reduce_grid(args.numel, blocks);
  ReduceOpArgs a = args;
  BulkReduce b = bulk ? bulk_reduce(a, dtype, combine) : BulkReduce{};
  if (b.kernel) {
    void* params[] = {&a, &b.chunk};
    return cudaLaunchKernel(b.kernel, dim3(grid), dim3(kThreads), params, b.smem_bytes, stream);
  }
  void* params[] = {&a};
  return cudaLaunchKernel(reduce_kernel_of(dtype, combine), dim3(grid), dim3(kThreads), params, 0,
                          stream);
}

}  // namespace odc
