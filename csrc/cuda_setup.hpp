// Layer 3, what a channel needs of CUDA, with no CUDA header in sight: the CUDA transport's
// factory and typed options, a GPU's identity, and the side streams of async collectives.
// cuda/cuda_setup.cpp implements it; a build without CUDA links host_only.cpp, whose
// versions refuse CUDA tensors. Depends on the transport interface and its set-up.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "rendezvous.hpp"
#include "transport.hpp"

namespace odc {

// What the CUDA transport is made from, beside the group's TransportArgs: from the options
// (ODC_REDUCE_BLOCKS, ...) and from where the ranks are (placement.hpp).
struct CudaTransportOptions {
  int device = 0;
  int reduce_blocks = 0;      // the owner's reduction kernel's grid
  int accumulate_blocks = 0;  // each peer's put-accumulate kernel (decoupled mode)
  size_t small_op_bytes = 0;  // operations at most this large run as one fused kernel
  int fused_blocks = 0;
  bool stream_memops = true;  // waits and signals as stream memory operations
  int ranks_on_gpu = 1;       // the group's ranks on this GPU (their kernels share its SMs)
  bool peers_on_other_gpus = false;  // some peer's memory is across NVLink
  bool zero_copy = false;     // direct collectives (ODC_ZERO_COPY; every peer mapped)
  // Windows and arenas in NVSHMEM's heap (routed[r]: peer r through NVSHMEM's API) instead
  // of CUDA IPC memory; pes[r] is group rank r's PE (its global rank).
  bool nvshmem = false;
  bool nvshmem_stage_always = false;
  std::vector<int> pes;
  std::vector<bool> routed;
};

std::unique_ptr<Transport> make_cuda_transport(const TransportArgs& a, const CudaTransportOptions& o);

// The UUID of GPU `device` (which GPU a rank uses, compared across ranks).
std::vector<uint8_t> gpu_uuid(int device);

// The stream a group's async collectives run on, its own while the group lives (another
// group's collectives on it would run in issue order behind this one's device-side waits,
// which can deadlock ranks that issue them in different orders), and never destroyed: the
// caching allocator records an event on every stream an async collective's tensors were
// recorded on when it frees them, also after the group is gone. A group gives its stream back
// when destroyed; later groups on that device take it again.
void* take_async_stream(int device);
void give_async_stream(int device, void* stream);

}  // namespace odc
