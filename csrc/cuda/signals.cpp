// Layer 2, a transport: how the CUDA transport issues its signals (cuda_transport.hpp):
// batched per lane, as stream memory operations or small kernels.
#include "cuda_transport.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace odc {

void CudaTransport::flush_signals(int lane) {
  if (pending_[lane].batches > 0) launch_flags(lane, nullptr);
}

void CudaTransport::issue_signal(int lane, const std::vector<uint64_t*>& flags,
                                    uint64_t value, bool payload) {
  if (memory_->any_routed()) {
    std::vector<uint64_t*> direct;
    bool prepared = false;
    for (uint64_t* f : flags) {
      if (!memory_->routed(f)) {
        direct.push_back(f);
        continue;
      }
      if (!prepared) {  // after the lane's earlier steps, pending direct signals included
        issue_prepare(lane);
        memory_->quiet_routed(lane_stream(lane));
        prepared = true;
      }
      memory_->signal_routed(f, value, lane_stream(lane));
    }
    if (!direct.empty()) issue_direct_signal(lane, direct, value, payload);
    return;
  }
  issue_direct_signal(lane, flags, value, payload);
}

void CudaTransport::issue_direct_signal(int lane, const std::vector<uint64_t*>& flags,
                                           uint64_t value, bool payload) {
  if (wait_value_) {
    // Stream memory operations: written at once, in protocol order. Held back until
    // the lane's next wait, a signal could queue behind a blocked wait of another
    // stream sharing its hardware queue, and two ranks would wait for each other.
    fork_lane(lane);
    const CUstream s = reinterpret_cast<CUstream>(lane_stream(lane));
    // Payloads too: the v2 entry points refuse CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER.
    for (uint64_t* f : flags) {
      if (write_value_(s, reinterpret_cast<CUdeviceptr>(f), value,
                       CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS) {
        throw std::runtime_error("odc: cuStreamWriteValue64 failed");
      }
    }
    return;
  }
  PendingSignals* p = &pending_[lane];
  if (p->batches > 0 && p->value[p->batches - 1] == value && p->payload[p->batches - 1] == payload &&
      p->flags[p->batches - 1].size() + flags.size() <= static_cast<size_t>(kMaxPeers)) {
    auto& last = p->flags[p->batches - 1];  // the same value: one batch
    last.insert(last.end(), flags.begin(), flags.end());
    return;
  }
  if (p->batches == kSignalBatches) {
    flush_signals(lane);
    p = &pending_[lane];
  }
  p->flags[p->batches].assign(flags.begin(), flags.end());
  p->value[p->batches] = value;
  p->payload[p->batches] = payload;
  ++p->batches;
}

// Before a data step on a lane: pending signals first, the lane forked from the op stream.

}  // namespace odc
