// Layer 2, a transport's memory: CUDA IPC (device_memory.hpp). Every rank cudaMallocs its
// window or arena and opens its peers' through CUDA IPC handles exchanged in the store.
#include <cstring>
#include <stdexcept>

#include "../placement.hpp"
#include "device_memory.hpp"

namespace odc {
namespace {

// CUDA IPC: cudaMalloc `bytes` (zeroed) on this GPU and open every rank's buffer through
// CUDA IPC (all ranks on one host; `tag` names the rendezvous in the store).
class IpcMemory final : public DeviceMemory {
 public:
  explicit IpcMemory(int device) : device_(device) {}
  std::vector<char*> open(const TransportArgs& a, const std::string& tag, size_t bytes,
                          const char* what) override;
  void close(const TransportArgs& a, std::vector<char*>& bases) override;

 private:
  int device_;
};

std::vector<char*> IpcMemory::open(const TransportArgs& a, const std::string& tag, size_t bytes,
                                   const char* what) {
  std::vector<char*> bases(a.world, nullptr);
  void* base = nullptr;
  cudaError_t e = cudaMalloc(&base, bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error("could not allocate the " + std::to_string(bytes >> 20) + " MiB " +
                             what + " on cuda:" + std::to_string(device_) + " (" +
                             cudaGetErrorString(e) +
                             "); free GPU memory or lower ODC_CHUNK_BYTES / ODC_RING_SLOTS");
  }
  bases[a.rank] = static_cast<char*>(base);
  check(cudaMemset(base, 0, bytes), "zeroing shared memory");
  check(cudaDeviceSynchronize(), "zeroing shared memory");

  cudaIpcMemHandle_t handle;
  check(cudaIpcGetMemHandle(&handle, base), "cudaIpcGetMemHandle");
  const std::string host = host_name();
  std::vector<uint8_t> mine(sizeof(handle) + host.size());
  std::memcpy(mine.data(), &handle, sizeof(handle));
  std::memcpy(mine.data() + sizeof(handle), host.data(), host.size());
  auto all = exchange_blobs(a, tag, mine);
  for (int r = 0; r < a.world; ++r) {
    if (r == a.rank) continue;
    const std::string peer_host(all[r].begin() + sizeof(handle), all[r].end());
    if (peer_host != host) {
      throw std::runtime_error("the CUDA IPC transport needs every rank on one host, but rank " +
                               std::to_string(r) + " is on '" + peer_host + "' and rank " +
                               std::to_string(a.rank) + " on '" + host + "'");
    }
    cudaIpcMemHandle_t h;
    std::memcpy(&h, all[r].data(), sizeof(h));
    void* p = nullptr;
    check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess),
          ("opening the " + std::string(what) + " of rank " + std::to_string(r)).c_str());
    bases[r] = static_cast<char*>(p);
  }
  return bases;
}

void IpcMemory::close(const TransportArgs& a, std::vector<char*>& bases) {
  for (int r = 0; r < static_cast<int>(bases.size()); ++r) {
    if (!bases[r]) continue;
    if (r == a.rank) {
      (void)cudaFree(bases[r]);
    } else {
      (void)cudaIpcCloseMemHandle(bases[r]);
    }
    bases[r] = nullptr;
  }
}

}  // namespace

std::unique_ptr<DeviceMemory> make_ipc_memory(int device) {
  return std::make_unique<IpcMemory>(device);
}

}  // namespace odc
