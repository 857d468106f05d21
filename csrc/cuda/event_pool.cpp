// Layer 2, a transport: the CUDA transport's pool of completion events (cuda_transport.hpp).
#include "cuda_transport.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace odc {

EventPool::~EventPool() {
  for (cudaEvent_t ev : free_) (void)cudaEventDestroy(ev);
}

cudaEvent_t EventPool::take() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!free_.empty()) {
      cudaEvent_t ev = free_.back();
      free_.pop_back();
      return ev;
    }
  }
  cudaEvent_t ev;
  check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "creating an event");
  return ev;
}

void EventPool::give(cudaEvent_t ev) {
  std::lock_guard<std::mutex> lk(mu_);
  free_.push_back(ev);
}

std::shared_ptr<void> EventPool::share(cudaEvent_t ev) {
  return std::shared_ptr<void>(ev, [pool = shared_from_this()](void* e) {
    pool->give(static_cast<cudaEvent_t>(e));
  });
}

// Polls the tracked operations. An operation counts as started once the GPU has
// reached it (its start event completed); if it is still unfinished a group timeout
// later, its first unmet wait names the peer, the error is recorded for the next
// call to raise, and every counter of this rank's window is set past any target so
// that the queued work drains instead of hanging the process.

}  // namespace odc
