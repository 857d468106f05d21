// Layer 2, a transport's kernels (kernels.cuh): decoupled mode's put-accumulate, float atomics
// into an owner's fp32 accumulator.
#include "device_common.cuh"

namespace odc {
namespace {

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


cudaError_t preload_accumulate_kernels() {
  cudaFuncAttributes attr;
  cudaError_t e = cudaFuncGetAttributes(&attr, accumulate_kernel<float>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, accumulate_kernel<__nv_bfloat16>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, accumulate_kernel<__half>);
  return e;
}

}  // namespace odc
