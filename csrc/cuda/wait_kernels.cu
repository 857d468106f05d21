// Layer 2, a transport's kernels (kernels.cuh): the one-warp kernels of the copy engines'
// steps: waits and signals (flag_kernel), and the gate and signal nodes of puts' graphs.
#include "device_common.cuh"

namespace odc {
namespace {

// One peer of a wait (WaitCheck): false, with the error recorded, on a timeout or a mismatch.
__device__ bool check_peer(const WaitCheck& c, const uint64_t* flag, const uint64_t* desc,
                           int peer, uint64_t start) {
  return wait_counter(flag, c.target, start, c.timeout_ns, c.err, peer, c.op_seq, c.op, c.what,
                      PeerWatch{c.watch_slots, c.watch_word}) &&
         (!c.desc_expected ||
          check_desc(desc, c.desc_expected, c.desc_id, c.err, peer, c.op_seq, c.op,
                     c.watch_slots ? c.watch_word : 0));
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
    if (!check_peer(op.check, op.wait[i], op.desc[i], op.wait_peer[i], start)) return;
  }
}

// A gate's waits (every thread of its block): true, in thread 0 only, where the group had not
// failed, every peer's counter arrived and its descriptor matched, and the group has still
// not failed (nothing goes into peers' memory after a failure).
__device__ bool gate_passes(const WaitCheck& c, const uint64_t* const* flag,
                            const uint64_t* const* desc, const int* peer, int n) {
  __shared__ int failed;
  volatile DeviceError* err = c.err;
  if (threadIdx.x == 0) failed = err->code != 0;
  __syncthreads();
  if (failed) return false;
  const uint64_t start = global_ns();
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    if (!check_peer(c, flag[i], desc[i], peer[i], start)) failed = 1;
  }
  __syncthreads();
  return !failed && threadIdx.x == 0 && err->code == 0;
}

__global__ void gate_kernel(const __grid_constant__ GateOp g) {
  if (!gate_passes(g.check, g.flag, g.desc, g.peer, g.n)) return;
  for (int i = 0; i < g.n; ++i) g.go[i] = g.check.target;  // ordered before the graph's next nodes
  cudaGraphSetConditional(g.cond, 1);
}

__global__ void guess_gate_kernel(const __grid_constant__ GuessGateOp g) {
  if (!gate_passes(g.check, g.flag, g.desc, g.peer, g.n)) return;
  unsigned long long confirmed = 0;
  for (int i = 0; i < g.n; ++i) {  // the words: stored before the "ready" just acquired
    if (load_acquire(g.where[i]) != g.guess[i]) continue;
    g.hits[i] = g.serial;  // ordered before the graph's next nodes and the stream's later work
    cudaGraphSetConditional(g.cond[i], 1);
    ++confirmed;
  }
  atomicAdd(&g.tally[0], static_cast<unsigned long long>(g.n));
  atomicAdd(&g.tally[1], confirmed);
}

__global__ void put_signal_kernel(const __grid_constant__ PutSignalOp p) {
  if (threadIdx.x != 0) return;
  fence_release();  // the copies (complete: graph order) before the counters, as a flag kernel
  for (int i = 0; i < p.n; ++i) store_relaxed(p.done[i], p.go[i]);
}

}  // namespace

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

cudaKernelNodeParams guess_gate_node_params(void** args) {
  return one_warp_node(reinterpret_cast<void*>(&guess_gate_kernel), args);
}

cudaKernelNodeParams put_signal_node_params(void** args) {
  return one_warp_node(reinterpret_cast<void*>(&put_signal_kernel), args);
}

cudaError_t launch_flag_op(const FlagOp& op, cudaStream_t stream) {
  flag_kernel<<<1, 32, 0, stream>>>(op);
  return cudaGetLastError();
}


cudaError_t preload_wait_kernels() {
  cudaFuncAttributes attr;
  const cudaError_t e = cudaFuncGetAttributes(&attr, flag_kernel);
  return e == cudaSuccess ? cudaFuncGetAttributes(&attr, guess_gate_kernel) : e;
}

}  // namespace odc
