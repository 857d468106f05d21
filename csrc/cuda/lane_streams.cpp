// Layer 2, a transport: the copy engines' lane streams (lane_streams.hpp).
#include "lane_streams.hpp"

#include <algorithm>

#include "device_memory.hpp"

namespace odc {

LaneStreams::~LaneStreams() {
  for (auto& [stream, l] : all_) {
    for (auto s : l.side) (void)cudaStreamDestroy(s);
    for (auto ev : l.join) (void)cudaEventDestroy(ev);
    (void)cudaEventDestroy(l.fork);
  }
}

LaneStreams::Lanes& LaneStreams::lanes_for(cudaStream_t stream) {
  for (auto& [s, l] : all_) {
    if (s == stream) return l;
  }
  Lanes l;
  int lo = 0, hi = 0;
  check(cudaDeviceGetStreamPriorityRange(&lo, &hi), "stream priorities");
  for (int i = 1; i < world_; ++i) {
    cudaStream_t s;
    cudaEvent_t ev;
    check(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, hi), "creating a lane stream");
    check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "creating an event");
    l.side.push_back(s);
    l.join.push_back(ev);
  }
  check(cudaEventCreateWithFlags(&l.fork, cudaEventDisableTiming), "creating an event");
  all_.emplace_back(stream, std::move(l));
  return all_.back().second;
}

void LaneStreams::begin(cudaStream_t stream) {
  op_ = stream;
  cur_ = &lanes_for(stream);
  std::fill(used_.begin(), used_.end(), false);
}

void LaneStreams::record_fork() {
  check(cudaEventRecord(cur_->fork, op_), "recording the fork event");
}

void LaneStreams::fork(int lane) {
  if (lane > 0 && !used_[lane]) {
    check(cudaStreamWaitEvent(stream(lane), cur_->fork, 0), "forking a lane");
    used_[lane] = true;
  }
}

void LaneStreams::join() {
  for (int lane = 1; lane < world_; ++lane) {
    if (!used_[lane]) continue;
    check(cudaEventRecord(cur_->join[lane - 1], cur_->side[lane - 1]), "recording a join event");
    check(cudaStreamWaitEvent(op_, cur_->join[lane - 1], 0), "joining a lane");
  }
}

}  // namespace odc
