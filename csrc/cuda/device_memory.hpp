// Layer 2, a transport's memory: where the CUDA transport's windows and arenas live and how
// peers reach them. Two kinds: CUDA IPC (ipc_memory.cpp, this host's GPUs) and NVSHMEM's
// symmetric heap (nvshmem_runtime.cpp, also peers on other hosts). Depends on the
// transport's set-up (../rendezvous.hpp: TransportArgs).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "../rendezvous.hpp"

namespace odc {

// A failed CUDA call of the CUDA transport's files, as an exception naming what it did.
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string("odc: ") + what + ": " + cudaGetErrorString(e));
  }
}

// Where a CUDA transport's windows and arenas live and how peers reach them: a cudaMalloc'd
// buffer opened by the peers through CUDA IPC (the default), or NVSHMEM's symmetric heap
// mapped peer-to-peer (ODC_TRANSPORT=nvshmem, nvshmem_runtime.cpp).
class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  // Collective over the group: `bytes` of zeroed memory on this GPU; returns every rank's
  // base as a pointer this GPU can load, store and copy through.
  virtual std::vector<char*> open(const TransportArgs& a, const std::string& tag, size_t bytes,
                                  const char* what) = 0;
  virtual void close(const TransportArgs& a, std::vector<char*>& bases) = 0;
  // Whether close() gives the memory back (NVSHMEM's heap keeps it: a bump allocator).
  virtual bool gives_back() const { return true; }

  // Routed peers (NVSHMEM's API path, e.g. GPUs on other hosts): their bases are placeholder
  // addresses that no kernel may touch; copies and signals that involve them go through
  // copy_routed / signal_routed on the lane's stream, in stream order. `slot` (ring x
  // world + lane) names the copy's staging room: copies with one slot never overlap in time
  // (one ring's operations run in order, one lane's steps in stream order).
  virtual bool any_routed() const { return false; }
  virtual bool routed(const void* p) const { return false; }
  virtual void copy_routed(int slot, void* dst, const void* src, size_t bytes, cudaStream_t s) {}
  // Before a step's routed signals: the lane's earlier routed puts have landed.
  virtual void quiet_routed(cudaStream_t s) {}
  virtual void signal_routed(uint64_t* flag, uint64_t value, cudaStream_t s) {}
};

// CUDA IPC memory on `device`: a cudaMalloc'd buffer per rank, opened by the peers.
std::unique_ptr<DeviceMemory> make_ipc_memory(int device);

}  // namespace odc
