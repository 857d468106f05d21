#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels.cuh"

namespace odc {
namespace {

__device__ __forceinline__ uint64_t load_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void flag_kernel(FlagOp op) {
  const int t = threadIdx.x;
  if (op.n_signal > 0) {
    __threadfence_system();
    for (int i = t; i < op.n_signal; i += blockDim.x) store_release(op.signal[i], op.signal_value);
  }
  if (op.n_wait == 0) return;
  volatile DeviceError* err = op.err;
  const uint64_t start = global_ns();
  for (int i = t; i < op.n_wait; i += blockDim.x) {
    uint64_t seen;
    uint32_t iter = 0;
    while ((seen = load_acquire(op.wait[i])) < op.wait_target) {
      if ((++iter & 1023u) != 0) continue;
      if (err->code != 0) return;  // the group already failed: drain the stream quickly
      if (global_ns() - start > op.timeout_ns) {
        err->peer = op.wait_peer[i];
        err->op_seq = op.op_seq;
        err->target = op.wait_target;
        err->seen = seen;
        err->op = op.op;
        err->what = op.what;
        __threadfence_system();
        err->code = 1;
        __threadfence_system();
        return;
      }
    }
  }
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

// out = scale * sum_j src[j], summed in fp32 in source (rank) order.
// A few blocks must stream at HBM speed, so each thread keeps kUnroll 16-byte
// loads of every source in flight before it accumulates (memory-level
// parallelism instead of occupancy: the kernel shares the GPU with compute).
constexpr int kUnroll = 4;

template <typename T>
__global__ void reduce_kernel(ReduceOpArgs a) {
  const float scale = a.scale_ptr ? *a.scale_ptr : a.scale;
  constexpr int V = 16 / sizeof(T);
  union U { uint4 raw; T e[V]; };
  const size_t threads = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nvec = a.vectorized ? a.numel / V : 0;
  const uint4* const* src = reinterpret_cast<const uint4* const*>(a.src);
  uint4* dst = static_cast<uint4*>(a.dst);
  // Groups of kUnroll vectors, strided by the grid: vector (base + u * threads).
  const size_t full = nvec / (threads * kUnroll) * (threads * kUnroll);
  for (size_t base = tid; base < full; base += threads * kUnroll) {
    float acc[kUnroll][V];
    U u[kUnroll];
#pragma unroll
    for (int r = 0; r < kUnroll; ++r) u[r].raw = src[0][base + r * threads];
#pragma unroll
    for (int r = 0; r < kUnroll; ++r)
#pragma unroll
      for (int k = 0; k < V; ++k) acc[r][k] = to_f<T>(u[r].e[k]);
    for (int j = 1; j < a.n_src; ++j) {
#pragma unroll
      for (int r = 0; r < kUnroll; ++r) u[r].raw = src[j][base + r * threads];
#pragma unroll
      for (int r = 0; r < kUnroll; ++r)
#pragma unroll
        for (int k = 0; k < V; ++k) acc[r][k] += to_f<T>(u[r].e[k]);
    }
#pragma unroll
    for (int r = 0; r < kUnroll; ++r) {
#pragma unroll
      for (int k = 0; k < V; ++k) u[r].e[k] = from_f<T>(acc[r][k] * scale);
      dst[base + r * threads] = u[r].raw;
    }
  }
  for (size_t i = full + tid; i < nvec; i += threads) {  // the vectors left over
    float acc[V];
    U u;
    u.raw = src[0][i];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = to_f<T>(u.e[k]);
    for (int j = 1; j < a.n_src; ++j) {
      u.raw = src[j][i];
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] += to_f<T>(u.e[k]);
    }
#pragma unroll
    for (int k = 0; k < V; ++k) u.e[k] = from_f<T>(acc[k] * scale);
    dst[i] = u.raw;
  }
  for (size_t i = nvec * V + tid; i < a.numel; i += threads) {  // elements, when unaligned
    float acc = to_f<T>(static_cast<const T*>(a.src[0])[i]);
    for (int j = 1; j < a.n_src; ++j) acc += to_f<T>(static_cast<const T*>(a.src[j])[i]);
    static_cast<T*>(a.dst)[i] = from_f<T>(acc * scale);
  }
}

}  // namespace

cudaError_t launch_flag_op(const FlagOp& op, cudaStream_t stream) {
  flag_kernel<<<1, 32, 0, stream>>>(op);
  return cudaGetLastError();
}

cudaError_t preload_kernels() {
  cudaFuncAttributes attr;
  cudaError_t e = cudaFuncGetAttributes(&attr, flag_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, reduce_kernel<float>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, reduce_kernel<__nv_bfloat16>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, reduce_kernel<__half>);
  return e;
}

cudaError_t launch_reduce(const ReduceOpArgs& args, DType dtype, int blocks, cudaStream_t stream) {
  constexpr int kThreads = 512;
  const size_t per_block = static_cast<size_t>(kThreads) * 8 * kUnroll;
  const int needed = static_cast<int>((args.numel + per_block - 1) / per_block);
  const int grid = needed < blocks ? (needed > 0 ? needed : 1) : blocks;
  switch (dtype) {
    case DType::F32: reduce_kernel<float><<<grid, kThreads, 0, stream>>>(args); break;
    case DType::BF16: reduce_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(args); break;
    case DType::F16: reduce_kernel<__half><<<grid, kThreads, 0, stream>>>(args); break;
  }
  return cudaGetLastError();
}

}  // namespace odc
