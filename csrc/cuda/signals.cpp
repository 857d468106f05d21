// Layer 2, a transport: how the CUDA transport's copy engines issue signals (copy_engines.hpp):
// batched per lane into its next flag kernel, or written at once as stream memory operations;
// routed peers' through the memory's own path.
#include "copy_engines.hpp"

namespace odc {

void CopyEngines::flush_signals(Issue& op, int lane) {
  if (pending_[lane].batches > 0) launch_flags(op, lane, nullptr);
}

void CopyEngines::flush_all_signals(Issue& op) {
  for (int lane = 0; lane < world_; ++lane) flush_signals(op, lane);
}

void CopyEngines::issue_signal(Issue& op, int lane, const std::vector<uint64_t*>& flags,
                               uint64_t value, bool payload) {
  DeviceMemory& memory = op.env.memory;
  if (!memory.any_routed()) {
    issue_direct_signal(op, lane, flags, value, payload);
    return;
  }
  std::vector<uint64_t*> direct;
  bool prepared = false;
  for (uint64_t* f : flags) {
    if (!memory.routed(f)) {
      direct.push_back(f);
      continue;
    }
    if (!prepared) {  // after the lane's earlier steps, pending direct signals included
      prepare(op, lane);
      memory.quiet_routed(lanes_.stream(lane));
      prepared = true;
    }
    memory.signal_routed(f, value, lanes_.stream(lane));
  }
  if (!direct.empty()) issue_direct_signal(op, lane, direct, value, payload);
}

void CopyEngines::issue_direct_signal(Issue& op, int lane, const std::vector<uint64_t*>& flags,
                                      uint64_t value, bool payload) {
  if (memops_) {
    // Stream memory operations: written at once, in protocol order. Held back until the
    // lane's next wait, a signal could queue behind a blocked wait of another stream sharing
    // its hardware queue, and two ranks would wait for each other.
    lanes_.fork(lane);
    for (uint64_t* f : flags) memops_.write(lanes_.stream(lane), f, value);
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
    flush_signals(op, lane);
    p = &pending_[lane];
  }
  p->flags[p->batches].assign(flags.begin(), flags.end());
  p->value[p->batches] = value;
  p->payload[p->batches] = payload;
  ++p->batches;
}

}  // namespace odc
