// Layer 2, a transport: the streams the CUDA transport's copy engines run an operation's lanes
// on (copy_engines.hpp). Side lanes belong to the stream an operation runs on, so that
// collectives issued on different user streams (FSDP's all-gather and reduce-scatter streams)
// never queue behind each other.
#pragma once

#include <cuda_runtime.h>

#include <list>
#include <utility>
#include <vector>

namespace odc {

class LaneStreams {
 public:
  explicit LaneStreams(int world) : world_(world), used_(world, false) {}
  ~LaneStreams();
  LaneStreams(const LaneStreams&) = delete;
  LaneStreams& operator=(const LaneStreams&) = delete;

  // An operation on `stream`: lane 0 is that stream, lane i > 0 a side stream of its own (made
  // at the stream's first operation), none forked yet.
  void begin(cudaStream_t stream);
  // What the side lanes of the operation start after: everything issued on its stream so far.
  void record_fork();
  cudaStream_t stream(int lane) const { return lane == 0 ? op_ : cur_->side[lane - 1]; }
  // A side lane's first step of the operation waits for the fork.
  void fork(int lane);
  // The operation's stream waits for every side lane the operation used.
  void join();

 private:
  struct Lanes {
    std::vector<cudaStream_t> side;  // lane i > 0 runs on side[i - 1]
    std::vector<cudaEvent_t> join;
    cudaEvent_t fork = nullptr;
  };
  Lanes& lanes_for(cudaStream_t stream);

  int world_;
  std::list<std::pair<cudaStream_t, Lanes>> all_;  // a list: cur_ must stay valid
  Lanes* cur_ = nullptr;
  cudaStream_t op_ = nullptr;
  std::vector<bool> used_;
};

}  // namespace odc
