// Layer 2, a transport: the CUDA transport's pool of events (cuda_transport.hpp).
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <mutex>
#include <vector>

namespace odc {

// Events reused rather than created and destroyed per operation (each a driver call). Shared
// by the transport and the events it hands out, which may outlive it (a Work's completion).
class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  ~EventPool();
  cudaEvent_t take();  // on the current device
  void give(cudaEvent_t ev);
  // `ev`, given back to the pool when its last holder drops it
  std::shared_ptr<void> share(cudaEvent_t ev);

 private:
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
};

}  // namespace odc
