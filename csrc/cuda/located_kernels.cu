// Layer 2, a transport's kernels (kernels.cuh): the located copy of the copy-engine path, a
// direct collective's read of a peer's input from where the peer said it lies (an SM copy: a
// copy engine needs its source when the copy is enqueued, before the peer has said).
#include "device_common.cuh"

namespace odc {
namespace {

constexpr int kLocatedThreads = 512;
// Bytes a block copies at least, so that a small copy holds few SMs.
constexpr size_t kLocatedBytesPerBlock = 1 << 20;

__global__ void __launch_bounds__(kLocatedThreads) located_copy_kernel(const __grid_constant__ LocatedCopyOp op) {
  __shared__ const char* src;
  if (threadIdx.x == 0) {
    src = resolve_located(op.src.where, op.src.owner, op.src.staged, op.src.offset, op.bytes,
                          op.segments, op.err, op.op_seq, op.op);
  }
  __syncthreads();
  if (!src) return;  // recorded; nothing is read
  size_t b, e;  // 16-byte units: every block's piece keeps the copy's alignment
  slice_of(op.bytes, 16, blockIdx.x, gridDim.x, &b, &e);
  block_copy(static_cast<char*>(op.dst) + b, src + b, e - b);
}

}  // namespace

cudaError_t launch_located_copy(const LocatedCopyOp& op, int blocks, cudaStream_t stream) {
  const size_t want = (op.bytes + kLocatedBytesPerBlock - 1) / kLocatedBytesPerBlock;
  const int grid = static_cast<int>(std::clamp<size_t>(want, 1, static_cast<size_t>(std::max(blocks, 1))));
  located_copy_kernel<<<grid, kLocatedThreads, 0, stream>>>(op);
  return cudaGetLastError();
}

cudaError_t preload_located_kernels() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, located_copy_kernel);
}

}  // namespace odc
