// Layer 2, a transport's kernels (kernels.cuh): the reductions of the copy engines (a
// register kernel for every dtype and combine; for floating-point Sums from other GPUs' memory,
// a kernel that streams tiles through the bulk-copy engine).
#include "device_common.cuh"

namespace odc {
namespace {

// The sources into `s` (shared memory), located ones resolved (ReduceOpArgs::where): 1 where
// every pointer is 16-byte aligned, 0 where not, -1 where a source has no mapping here
// (recorded: nothing may be read).
__device__ int load_sources(const ReduceOpArgs& a, const void** s) {
  __shared__ int vec;
  if (threadIdx.x < a.n_src) {
    const int j = threadIdx.x;
    s[j] = a.where[j] ? resolve_located(a.where[j], j, static_cast<const char*>(a.src[j]),
                                        a.located_offset, a.numel * a.elem_size, a.segments, a.err,
                                        a.op_seq, a.op)
                      : a.src[j];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uintptr_t mis = reinterpret_cast<uintptr_t>(a.dst);
    bool all = true;
    for (int j = 0; j < a.n_src; ++j) {
      all = all && s[j] != nullptr;
      mis |= reinterpret_cast<uintptr_t>(s[j]);
    }
    vec = !all ? -1 : (a.vectorized && mis % 16 == 0 ? 1 : 0);
  }
  __syncthreads();
  return vec;
}

// The vectors from `from_vec` on, then (when unaligned) the elements: one per thread,
// strided by the grid, in source order (the two reduce kernels' remainders).
template <typename T, Combine C>
__device__ __forceinline__ void reduce_rest(const ReduceOpArgs& a, const void* const* srcs, bool vectorized,
                                            size_t from_vec, size_t tid, size_t threads,
                                            typename AccOf<T>::type scale, bool scaled) {
  using A = typename AccOf<T>::type;
  constexpr int V = 16 / sizeof(T);
  union U { uint4 raw; T e[V]; };
  const size_t nvec = vectorized ? a.numel / V : 0;
  const uint4* const* src = reinterpret_cast<const uint4* const*>(srcs);
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
    A acc = to_acc<T, A>(static_cast<const T*>(srcs[0])[i]);
    for (int j = 1; j < a.n_src; ++j) {
      acc = combine<C>(acc, to_acc<T, A>(static_cast<const T*>(srcs[j])[i]));
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
  __shared__ const void* srcs[kMaxPeers];
  const int vectorized = load_sources(a, srcs);
  if (vectorized < 0) return;
  using A = typename AccOf<T>::type;
  const A scale = a.scale_ptr ? static_cast<A>(*a.scale_ptr) : static_cast<A>(a.scale);
  const bool scaled = C == Combine::Sum && (a.scale_ptr != nullptr || a.scale != 1.0);
  constexpr int V = 16 / sizeof(T);
  union U { uint4 raw; T e[V]; };
  const size_t threads = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nvec = vectorized ? a.numel / V : 0;
  const uint4* const* src = reinterpret_cast<const uint4* const*>(srcs);
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
  reduce_rest<T, C>(a, srcs, vectorized, full, tid, threads, scale, scaled);
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

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The stages' barriers, each expecting one arrival (thread 0's, with the bytes it fetches).
__device__ __forceinline__ void init_stages(unsigned long long* landed) {
  for (int s = 0; s < kPipeStages; ++s) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&landed[s])) : "memory");
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Until the stage's barrier `bar` completed its phase `parity` (its tiles have landed).
__device__ __forceinline__ void wait_stage(unsigned bar, unsigned parity) {
  unsigned ready = 0;
  while (!ready) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(ready)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}
#endif

// A tile is `chunk` bytes of every source; tiles go to blocks round robin.
template <typename T>
__global__ void __launch_bounds__(kReduceThreads) reduce_bulk_kernel(ReduceOpArgs a, int chunk) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char tiles[];  // [stage][source][chunk]
  __shared__ __align__(8) unsigned long long landed[kPipeStages];  // an mbarrier per stage
  __shared__ const void* srcs[kMaxPeers];
  const int vectorized = load_sources(a, srcs);
  if (vectorized < 0) return;
  const float scale = a.scale_ptr ? *a.scale_ptr : static_cast<float>(a.scale);
  const bool scaled = a.scale_ptr != nullptr || a.scale != 1.0;
  constexpr int V = 16 / sizeof(T);
  union U { uint4 raw; T e[V]; };
  const int n = a.n_src;
  const size_t tile_vecs = chunk / 16;
  // (launched where the host found the inputs aligned; a located one found unaligned: no tiles)
  const size_t n_tiles = vectorized ? a.numel / V / tile_vecs : 0;
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
      const char* from = static_cast<const char*>(srcs[j]) + tile_of(i) * chunk;
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
              smem_addr(slot(i, j))),
          "l"(from), "r"(chunk), "r"(bar)
          : "memory");
    }
  };
  if (threadIdx.x == 0) init_stages(landed);
  __syncthreads();
  if (threadIdx.x == 0) {
    for (size_t i = 0; i < kPipeStages && i < mine; ++i) fetch(i);
  }
  uint4* dst = static_cast<uint4*>(a.dst);
  for (size_t i = 0; i < mine; ++i) {
    wait_stage(smem_addr(&landed[i % kPipeStages]), (i / kPipeStages) & 1);
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
  reduce_rest<T, Combine::Sum>(a, srcs, vectorized, n_tiles * tile_vecs, blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x,
                               static_cast<size_t>(gridDim.x) * blockDim.x, scale, scaled);
#endif
}

}  // namespace

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


cudaError_t preload_reduce_kernels(int device) {
  cudaFuncAttributes attr;
  cudaError_t e = cudaSuccess;
  for (int d = 0; d <= static_cast<int>(DType::I8) && e == cudaSuccess; ++d) {
    for (int c = 0; c <= static_cast<int>(Combine::Product) && e == cudaSuccess; ++c) {
      e = cudaFuncGetAttributes(&attr, reduce_kernel_of(static_cast<DType>(d), static_cast<Combine>(c)));
    }
  }
  // The bulk reductions (Hopper and later) take up to kPipeBytes of shared memory per block.
  int major = 0, optin = 0;
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  const int smem = major >= 9 ? std::min(kPipeBytes, optin - 1024) : 0;  // 1 KiB: the static barriers and sources
  for (DType d : {DType::F32, DType::BF16, DType::F16}) {
    if (e == cudaSuccess && smem > 0) {
      e = cudaFuncSetAttribute(bulk_kernel_of(d), cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    }
  }
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
