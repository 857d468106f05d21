// Layer 2, a transport: the CUDA transport's fused engine (fused_engine.hpp).
#include "fused_engine.hpp"

#include <algorithm>

namespace odc {

FusedEngine::FusedEngine(int world, size_t small_op_bytes, int max_blocks)
    : world_(world), small_op_bytes_(small_op_bytes), max_blocks_(max_blocks) {
  const size_t bytes = sizeof(unsigned) * kFusedArrivalsPerOp * kNumRings;
  check(cudaMalloc(reinterpret_cast<void**>(&arrivals_), bytes), "allocating the fused kernel's counters");
  check(cudaMemset(arrivals_, 0, bytes), "zeroing the fused kernel's counters");
}

FusedEngine::~FusedEngine() {
  if (arrivals_) (void)cudaFree(arrivals_);
}

bool FusedEngine::fits(const Step& s) const {
  if (s.kind() == kStepAccumulate || s.kind() == kStepZero) return false;
  if (s.data_bytes() > small_op_bytes_) return false;
  const ReduceStep* red = s.as_reduction();
  if (red && (red->spec.combine != Combine::Sum ||
              static_cast<int>(red->spec.dtype) > static_cast<int>(DType::F16))) {
    return false;  // the fused kernel sums fp32 / bf16 / fp16 only
  }
  return true;
}
static_assert(kFusedMaxPtrs <= kFusedThreads, "a thread per counter or source of a step");

bool FusedEngine::plan(const StepRecording& r, bool any_routed) {
  if (small_op_bytes_ == 0 || any_routed || world_ > kFusedMaxLanes ||
      r.size() > static_cast<size_t>(kFusedMaxSteps) ||
      r.word_count() > static_cast<size_t>(kFusedMaxPtrs)) {
    return false;
  }
  for (const Step& s : r.steps()) {
    if (!fits(s)) return false;
  }
  return plan_blocks(r);
}

// Blocks per lane: none for a lane without steps, one for a lane without data, else enough
// that each moves about kFusedBytesPerBlock of the lane's largest copy or reduction; at most
// max_blocks_ in all (or one per lane, where there are more lanes). False (the copy-engine
// path) where a block would have more than kFusedMaxBytesPerBlock to move.
bool FusedEngine::plan_blocks(const StepRecording& r) {
  int lanes_with_data = 0, lanes_without = 0;
  size_t bytes[kFusedMaxLanes] = {};  // plan() checked world <= kFusedMaxLanes
  bool has_steps[kFusedMaxLanes] = {};
  for (const Step& s : r.steps()) {
    const size_t each = s.data_bytes();
    const ReduceStep* red = s.as_reduction();
    const size_t b = red ? each * red->srcs.n : each;
    if (b && !bytes[s.lane]) ++lanes_with_data;
    bytes[s.lane] = std::max(bytes[s.lane], b);
    has_steps[s.lane] = true;
  }
  for (int lane = 0; lane < world_; ++lane) lanes_without += has_steps[lane] && !bytes[lane];
  const size_t cap = std::max(1, (max_blocks_ - lanes_without) / std::max(1, lanes_with_data));
  plan_.assign(world_, 0);
  for (int lane = 0; lane < world_; ++lane) {
    if (!has_steps[lane]) continue;
    const size_t want = (bytes[lane] + kFusedBytesPerBlock - 1) / kFusedBytesPerBlock;
    plan_[lane] = static_cast<int>(std::clamp<size_t>(want, 1, cap));
    if (bytes[lane] > plan_[lane] * kFusedMaxBytesPerBlock) return false;
  }
  return true;
}

std::vector<const Step*> FusedEngine::lane_order(const StepRecording& r, FusedOp& op) const {
  std::vector<const Step*> order;
  order.reserve(r.size());
  for (int lane = 0; lane < world_; ++lane) {
    op.lane_begin[lane] = static_cast<unsigned short>(order.size());
    size_t run = order.size();  // where the current run of signals and stores begins
    for (const Step& s : r.steps()) {
      if (s.lane != lane) continue;
      if (s.kind() == kStepStore) {
        order.insert(order.begin() + static_cast<std::ptrdiff_t>(run), &s);
        ++run;
      } else {
        order.push_back(&s);
        if (s.kind() != kStepSignal) run = order.size();
      }
    }
  }
  op.lane_begin[world_] = static_cast<unsigned short>(order.size());
  return order;
}

void FusedEngine::encode(const Step& s, FusedStep& f, FusedOp& op) const {
  f.kind = s.kind();
  auto words = [&f](const WordRange& w) {
    f.first = static_cast<uint16_t>(w.first);
    f.n = static_cast<uint16_t>(w.n);
  };
  if (auto* w = s.as<WaitStep>()) {
    words(w->counters);
    f.value = w->target;
    f.check = FusedCheck{w->checked ? w->desc : 0, w->desc_id};
    f.what = w->site.what;
    op.op_seq = w->site.op_seq;
    op.op = w->site.op;
  } else if (auto* g = s.as_signal()) {
    words(g->counters);
    f.value = g->value;
  } else if (auto* c = s.as<CopyStep>()) {
    f.dst = c->dst;
    f.src = c->src;
    f.value = c->bytes;
  } else if (auto* red = s.as_reduction()) {
    words(red->srcs);
    f.dst = red->dst;
    f.dtype = static_cast<uint8_t>(red->spec.dtype);
    f.scale = static_cast<float>(red->spec.scale);
    f.scale_ptr = red->spec.scale_ptr;
    f.value = red->numel;
    if (auto* lr = s.as<LocatedReduceStep>()) f.located = FusedLocated{nullptr, lr->offset};
  } else if (auto* lc = s.as<LocatedCopyStep>()) {
    f.dst = lc->dst;
    f.src = lc->src.staged;
    f.owner = static_cast<uint16_t>(lc->src.owner);
    f.located = FusedLocated{lc->src.where, lc->src.offset};
    f.value = lc->bytes;
  } else if (auto* lp = s.as<LocatedPushStep>()) {
    f.src = lp->src;
    f.owner = static_cast<uint16_t>(lp->dst.owner);
    f.located = FusedLocated{lp->dst.where, lp->dst.offset};
    f.value = lp->bytes;
  }
}

Transport::EngineUse FusedEngine::run(const StepRecording& r, const OpEnv& env) {
  FusedOp op{};
  op.lanes = world_;
  op.timeout_ns = static_cast<unsigned long long>(env.args.timeout().count()) * 1000000ull;
  op.err = env.err;
  op.watch_slots = env.watch.slots;
  op.watch_word = env.watch.word;
  op.segments = env.segments;
  const std::vector<const Step*> order = lane_order(r, op);
  int blocks = 0;  // plan()'s
  for (int lane = 0; lane < world_; ++lane) {
    op.block_begin[lane] = static_cast<unsigned short>(blocks);
    blocks += plan_[lane];
  }
  op.block_begin[world_] = static_cast<unsigned short>(blocks);
  op.arrivals = arrivals_ + static_cast<size_t>(ring_index(env.ring)) * kFusedArrivalsPerOp;
  for (size_t k = 0; k < order.size(); ++k) encode(*order[k], op.steps[k], op);
  for (size_t i = 0; i < r.word_count(); ++i) {
    op.ptrs[i] = r.word(static_cast<int>(i));
    op.peers[i] = static_cast<short>(r.peer(static_cast<int>(i)));
  }
  check(launch_fused(op, env.device, env.stream), "launching the fused collective kernel");
  return Transport::EngineUse{Transport::EngineUse::kFused, blocks};
}

}  // namespace odc
