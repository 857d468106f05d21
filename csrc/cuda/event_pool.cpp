// Layer 2, a transport: the CUDA transport's pool of events (event_pool.hpp).
#include "event_pool.hpp"

#include "device_memory.hpp"

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

}  // namespace odc
