// Layer 2, a transport's kernels (kernels.cuh): preload_kernels; the kernels are in files by
// kind: wait_kernels.cu, reduce_kernels.cu, fused_kernel.cu, accumulate_kernel.cu,
// located_kernels.cu (their
// shared device helpers: device_common.cuh).
#include "device_common.cuh"

namespace odc {

cudaError_t preload_kernels() {
  int device = 0;
  cudaError_t e = preload_wait_kernels();
  if (e == cudaSuccess) e = preload_fused_kernel();
  if (e == cudaSuccess) e = preload_accumulate_kernels();
  if (e == cudaSuccess) e = preload_located_kernels();
  if (e == cudaSuccess) e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = preload_reduce_kernels(device);
  if (e == cudaSuccess) resolve_fused_launch(device);
  return e;
}

}  // namespace odc
