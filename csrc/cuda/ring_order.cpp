// Layer 2, a transport: the order between the CUDA transport's operations (ring_order.hpp).
#include "ring_order.hpp"

#include "device_memory.hpp"

namespace odc {
namespace {
cudaEvent_t event_of(const std::shared_ptr<void>& e) { return static_cast<cudaEvent_t>(e.get()); }
}  // namespace

void RingOrder::wait_for(cudaStream_t stream, Ring ring) const {
  const int r = ring_index(ring);
  if (done_[r] && stream_[r] != stream) {
    check(cudaStreamWaitEvent(stream, event_of(done_[r]), 0), "ordering after the ring's last op");
  }
}

void RingOrder::before(cudaStream_t stream, Ring ring, Ring also) {
  wait_for(stream, ring);
  if (also != Ring::kNone) wait_for(stream, also);
  if (ring == Ring::kArenaSync) {
    // A minibatch's sync (Done signals, taking the accumulators) comes after every
    // accumulate and get issued before it, whatever streams FSDP issued them on.
    wait_for(stream, Ring::kArenaPut);
    wait_for(stream, Ring::kArenaGet);
  }
}

void RingOrder::after(cudaStream_t stream, Ring ring, Ring also) {
  // A new event per op (a Work may still hold the last one: completion()); the pool
  // recycles them.
  std::shared_ptr<void> done = events_->share(events_->take());
  check(cudaEventRecord(event_of(done), stream), "recording the ring's last op");
  for (Ring r : {ring, also}) {
    if (r == Ring::kNone) continue;
    done_[ring_index(r)] = done;
    stream_[ring_index(r)] = stream;
  }
  last_ = done;
  last_stream_ = stream;
}

void RingOrder::clear() {
  for (auto& d : done_) d.reset();
  last_.reset();
}

std::shared_ptr<void> RingOrder::record(cudaStream_t stream) {
  std::shared_ptr<void> done = events_->share(events_->take());
  check(cudaEventRecord(event_of(done), stream), "recording a collective's end");
  return done;
}

}  // namespace odc
