// Layer 2, a transport: the order the CUDA transport keeps between operations (Ring,
// ../transport.hpp): a ring's chunk counters assume its operations run in issue order, so one
// issued on another stream than the previous one of its ring first waits for that one.
#pragma once

#include <cuda_runtime.h>

#include <memory>

#include "../transport.hpp"
#include "event_pool.hpp"

namespace odc {

class RingOrder {
 public:
  // Before an operation of `ring` (and `also`) on `stream`.
  void before(cudaStream_t stream, Ring ring, Ring also);
  // At its end: it becomes its rings' last operation, with an event recorded on `stream`.
  void after(cudaStream_t stream, Ring ring, Ring also);
  // A new operation begins: the last one's event no longer serves completion().
  void forget_last() { last_.reset(); }
  // Drops every event held (the transport goes; a Work may still hold some).
  void clear();
  // Transport::completion: the last operation's end event where it serves (nothing was
  // issued on `stream` since), else null: then record(), on the current device.
  std::shared_ptr<void> last_on(cudaStream_t stream, bool after_last_op) const {
    return after_last_op && last_ && last_stream_ == stream ? last_ : nullptr;
  }
  std::shared_ptr<void> record(cudaStream_t stream);
  std::shared_ptr<void> last_of(Ring ring) const { return done_[ring_index(ring)]; }
  EventPool& events() { return *events_; }
  const std::shared_ptr<EventPool>& event_pool() const { return events_; }

 private:
  void wait_for(cudaStream_t stream, Ring ring) const;

  std::shared_ptr<EventPool> events_ = std::make_shared<EventPool>();
  cudaStream_t stream_[kNumRings] = {};    // the stream of each ring's last op
  std::shared_ptr<void> done_[kNumRings];  // recorded at the end of that op
  std::shared_ptr<void> last_;             // the last op's, if none began since
  cudaStream_t last_stream_ = nullptr;
};

}  // namespace odc
