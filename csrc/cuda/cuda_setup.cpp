// Layer 3, what a channel needs of CUDA (../cuda_setup.hpp): the CUDA transport over CUDA IPC
// or NVSHMEM memory, a GPU's UUID, the async side streams.
#include "../cuda_setup.hpp"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <map>
#include <mutex>

#include "cuda_transport.hpp"
#include "nvshmem_runtime.hpp"

namespace odc {

std::unique_ptr<Transport> make_cuda_transport(const TransportArgs& a, const CudaTransportOptions& o) {
  std::unique_ptr<DeviceMemory> memory =
      o.nvshmem ? nvshmem::make_memory(o.pes, o.routed, o.device, o.nvshmem_stage_always)
                : make_ipc_memory(o.device);
  return std::make_unique<CudaTransport>(a, o, std::move(memory));
}

std::vector<uint8_t> gpu_uuid(int device) {
  cudaDeviceProp prop;
  C10_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return std::vector<uint8_t>(prop.uuid.bytes, prop.uuid.bytes + sizeof(prop.uuid.bytes));
}

namespace {
std::mutex g_async_mu;
std::map<int, std::vector<void*>>& free_async_streams() {
  static auto* free = new std::map<int, std::vector<void*>>();  // never destroyed, as its streams
  return *free;
}
}  // namespace

void* take_async_stream(int device) {
  {
    std::lock_guard<std::mutex> lock(g_async_mu);
    auto& free = free_async_streams()[device];
    if (!free.empty()) {
      void* s = free.back();
      free.pop_back();
      return s;
    }
  }
  c10::cuda::CUDAGuard g(static_cast<c10::DeviceIndex>(device));
  cudaStream_t s;
  int lo = 0, hi = 0;
  C10_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  C10_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, hi));
  return s;
}

void give_async_stream(int device, void* stream) {
  std::lock_guard<std::mutex> lock(g_async_mu);
  free_async_streams()[device].push_back(stream);
}

}  // namespace odc
