// Layer 2, a transport: the CUDA transport's fused engine (cuda_transport.hpp): an operation's
// recorded steps run as one kernel, its lanes on blocks of their own.
#include "cuda_transport.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace odc {

// ---- The fused engine.

bool CudaTransport::fusable() {
  if (small_op_bytes_ == 0 || memory_->any_routed() || a_.world > kFusedMaxLanes ||
      steps_.size() > static_cast<size_t>(kFusedMaxSteps) ||
      ptrs_.size() > static_cast<size_t>(kFusedMaxPtrs)) {
    return false;
  }
  for (const Step& s : steps_) {
    if (s.kind == kStepAccumulate || s.kind == kStepZero) return false;
    if ((s.kind == kStepCopy || s.kind == kStepCopyLocated) && s.value > small_op_bytes_) return false;
    if ((s.kind == kStepReduce || s.kind == kStepReduceLocated) &&
        (s.value * dtype_size(s.spec.dtype) > small_op_bytes_ || s.spec.combine != Combine::Sum ||
         static_cast<int>(s.spec.dtype) > static_cast<int>(DType::F16))) {
      return false;  // the fused kernel sums fp32 / bf16 / fp16 only
    }
    if (s.n > kFusedThreads) return false;
  }
  return plan_fused_blocks();
}

// Blocks per lane: none for a lane without steps, one for a lane without data, else enough
// that each moves about kFusedBytesPerBlock of the lane's largest copy or reduction; at most
// fused_blocks_ in all (or one per lane, where there are more lanes). False (the copy-engine
// path) where a block would have more than kFusedMaxBytesPerBlock to move.
bool CudaTransport::plan_fused_blocks() {
  int lanes_with_data = 0, lanes_without = 0;
  size_t bytes[kFusedMaxLanes] = {};  // fusable() checked world <= kFusedMaxLanes
  bool has_steps[kFusedMaxLanes] = {};
  for (const Step& s : steps_) {
    const bool copy = s.kind == kStepCopy || s.kind == kStepCopyLocated;
    const bool reduce = s.kind == kStepReduce || s.kind == kStepReduceLocated;
    const size_t b = copy     ? s.value
                     : reduce ? s.value * dtype_size(s.spec.dtype) * s.n
                              : 0;
    if (b && !bytes[s.lane]) ++lanes_with_data;
    bytes[s.lane] = std::max(bytes[s.lane], b);
    has_steps[s.lane] = true;
  }
  for (int lane = 0; lane < a_.world; ++lane) lanes_without += has_steps[lane] && !bytes[lane];
  const size_t cap = std::max(1, (fused_blocks_ - lanes_without) / std::max(1, lanes_with_data));
  fused_plan_.assign(a_.world, 0);
  for (int lane = 0; lane < a_.world; ++lane) {
    if (!has_steps[lane]) continue;
    const size_t want = (bytes[lane] + kFusedBytesPerBlock - 1) / kFusedBytesPerBlock;
    fused_plan_[lane] = static_cast<int>(std::clamp<size_t>(want, 1, cap));
    if (bytes[lane] > fused_plan_[lane] * kFusedMaxBytesPerBlock) return false;
  }
  return true;
}

void CudaTransport::run_fused() {
  FusedOp op{};
  op.lanes = a_.world;
  op.timeout_ns = static_cast<unsigned long long>(a_.timeout().count()) * 1000000ull;
  op.err = err_dev_;
  op.watch_slots = watch_.slots;
  op.watch_word = watch_.word;
  op.segments = segments_ ? segments_->views() : nullptr;
  // Steps grouped by lane, in issue order, except that in a run of signals and stores the
  // stores go first: the run then costs one fence (Transport::signal / store's contract).
  std::vector<const Step*> order;
  order.reserve(steps_.size());
  for (int lane = 0; lane < a_.world; ++lane) {
    op.lane_begin[lane] = static_cast<unsigned short>(order.size());
    size_t run = order.size();  // where the current run of signals and stores begins
    for (const Step& s : steps_) {
      if (s.lane != lane) continue;
      if (s.kind == kStepStore) {
        order.insert(order.begin() + static_cast<std::ptrdiff_t>(run), &s);
        ++run;
      } else {
        order.push_back(&s);
        if (s.kind != kStepSignal) run = order.size();
      }
    }
  }
  op.lane_begin[a_.world] = static_cast<unsigned short>(order.size());
  int blocks = 0;  // fusable()'s plan
  for (int lane = 0; lane < a_.world; ++lane) {
    op.block_begin[lane] = static_cast<unsigned short>(blocks);
    blocks += fused_plan_[lane];
  }
  op.block_begin[a_.world] = static_cast<unsigned short>(blocks);
  op.arrivals = arrivals_ + static_cast<size_t>(ring_) * kFusedArrivalsPerOp;
  last_use_ = EngineUse{EngineUse::kFused, blocks};
  for (size_t k = 0; k < order.size(); ++k) {
    const Step& s = *order[k];
    FusedStep& f = op.steps[k];
    f.kind = s.kind;
    f.dtype = static_cast<uint8_t>(s.spec.dtype);
    f.n = static_cast<uint16_t>(s.n);
    f.first = static_cast<uint16_t>(s.first);
    f.scale = static_cast<float>(s.spec.scale);
    f.scale_ptr = s.spec.scale_ptr;
    f.value = s.value;
    f.desc = s.desc;
    f.desc_id = s.desc_id;
    f.dst = s.dst;
    f.src = s.src;
    f.what = s.site.what;
    if (s.kind == kStepWait) {
      op.op_seq = s.site.op_seq;
      op.op = s.site.op;
    }
  }
  for (size_t i = 0; i < ptrs_.size(); ++i) {
    op.ptrs[i] = ptrs_[i];
    op.peers[i] = static_cast<short>(peers_[i]);
  }
  check(launch_fused(op, device_, op_stream_), "launching the fused collective kernel");
}

}  // namespace odc
