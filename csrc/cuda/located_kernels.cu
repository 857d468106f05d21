// Layer 2, a transport's kernels (kernels.cuh): the located copy of the copy-engine path, a
// direct collective's read of a peer's input from where the peer said it lies, or its push
// into a peer's output where the peer said that lies (an SM copy: a copy engine needs both
// addresses when the copy is enqueued, before the peer has said).
#include "device_common.cuh"

namespace odc {
namespace {

constexpr int kLocatedThreads = 512;
// Bytes a block copies at least, so that a small copy holds few SMs.
constexpr size_t kLocatedBytesPerBlock = 1 << 20;

__global__ void __launch_bounds__(kLocatedThreads) located_copy_kernel(const __grid_constant__ LocatedCopyOp op) {
  __shared__ const char* far;  // the peer's side: the source, or a push's destination
  if (op.hit && *static_cast<const volatile uint64_t*>(op.hit) == op.serial) return;  // copied already
  if (threadIdx.x == 0) {
    far = resolve_located(op.far.where, op.far.owner, op.far.staged, op.far.offset, op.bytes,
                          op.segments, op.err, op.op_seq, op.op);
  }
  __syncthreads();
  if (!far) return;  // recorded, or a push to a peer that reads for itself: nothing moves
  size_t b, e;  // 16-byte units: every block's piece keeps the copy's alignment
  slice_of(op.bytes, 16, blockIdx.x, gridDim.x, &b, &e);
  if (op.push) {
    block_copy(const_cast<char*>(far) + b, static_cast<const char*>(op.local) + b, e - b);
  } else {
    block_copy(static_cast<char*>(op.local) + b, far + b, e - b);
  }
}

}  // namespace

int located_grid(size_t bytes, int blocks) {
  const size_t want = (bytes + kLocatedBytesPerBlock - 1) / kLocatedBytesPerBlock;
  return static_cast<int>(std::clamp<size_t>(want, 1, static_cast<size_t>(std::max(blocks, 1))));
}

cudaError_t launch_located_copy(const LocatedCopyOp& op, int blocks, cudaStream_t stream) {
  located_copy_kernel<<<located_grid(op.bytes, blocks), kLocatedThreads, 0, stream>>>(op);
  return cudaGetLastError();
}

cudaError_t preload_located_kernels() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, located_copy_kernel);
}

}  // namespace odc
