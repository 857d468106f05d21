// Layer 2, a transport: the CUDA transport's copy engines (copy_engines.hpp).
#include "copy_engines.hpp"

#include <algorithm>
#include <stdexcept>

namespace odc {
namespace {

// Data on one lane only (a zero-copy all-gather of 2 ranks, any zero-copy reduce-scatter):
// nothing to overlap, so every lane runs on the operation's stream in issue order (which is
// deadlock-free, see issue_step). Fewer launches and no fork or join; waits and signals of one
// point share a flag kernel.
bool one_lane_carries_data(const StepRecording& r, const DeviceMemory& memory) {
  if (memory.any_routed()) return false;
  int data_lane = -1;
  for (const Step& s : r.steps()) {
    if (!s.is_data()) continue;
    if (data_lane >= 0 && s.lane != data_lane) return false;
    data_lane = s.lane;
  }
  return true;
}

}  // namespace

CopyEngines::CopyEngines(int world, const Options& o, StreamMemops memops)
    : world_(world),
      reduce_blocks_(o.reduce_blocks),
      accumulate_blocks_(o.accumulate_blocks),
      peers_on_other_gpus_(o.peers_on_other_gpus),
      memops_(memops),
      lanes_(world),
      pending_(world) {}

Transport::EngineUse CopyEngines::run(StepRecording& r, const OpEnv& env, EventPool& events,
                                      Watchdog* watchdog) {
  const std::vector<PutGraphs::Run> puts = puts_.prepare(r, env);
  const bool one_lane = one_lane_carries_data(r, env.memory);
  if (one_lane) r.merge_lanes();
  lanes_.begin(env.stream);
  cudaEvent_t start = nullptr;
  if (watchdog) {
    start = events.take();
    check(cudaEventRecord(start, env.stream), "recording an event");
  }
  if (!one_lane) lanes_.record_fork();
  Issue op{r, env, std::vector<bool>(world_, false), 0, {}, {}};
  size_t next_puts = 0;
  for (size_t i = 0; i < r.size(); ++i) {
    if (r.steps()[i].guarded) {  // a run of puts: one graph on the op stream
      const PutGraphs::Run& run = puts[next_puts++];
      flush_all_signals(op);  // after every signal issued before them ("ready" among them)
      puts_.launch(run, r, env);
      op.flagged[0] = true;  // the gates: one block at a time
      i = run.end - 1;
      continue;
    }
    issue_step(op, r.steps()[i]);
  }
  flush_all_signals(op);
  lanes_.join();
  if (watchdog) {
    cudaEvent_t end = events.take();
    check(cudaEventRecord(end, env.stream), "recording an event");
    watchdog->track(start, end, std::move(op.waits), env.watch);
  }
  // The SMs it may hold at once: its largest reduction, and a flag kernel per lane that ran one.
  return Transport::EngineUse{
      Transport::EngineUse::kCopyEngine,
      op.reduce_blocks + static_cast<int>(std::count(op.flagged.begin(), op.flagged.end(), true))};
}

void CopyEngines::issue_step(Issue& op, const Step& s) {
  const int lane = s.lane;
  switch (s.kind()) {
    case kStepWait:
      // Signals issued on other lanes before this wait go out first. Streams may share a
      // hardware queue (few connections per process, fewer under MPS), and a queue runs
      // in order: a signal held back behind this wait could then wait for it, and two
      // ranks would wait for each other. Issue order itself is deadlock-free (the
      // protocol's chunk-major order), so keeping every queue in issue order is too.
      for (int other = 0; other < world_; ++other) {
        if (other != lane) flush_signals(op, other);
      }
      launch_flags(op, lane, s.as<WaitStep>());
      break;
    case kStepSignal:
    case kStepStore: {
      const SignalStep& g = *s.as_signal();
      op.words.clear();
      for (int i = 0; i < g.counters.n; ++i) op.words.push_back(op.r.counter(g.counters.first + i));
      issue_signal(op, lane, op.words, g.value, /*payload=*/s.kind() == kStepStore);
      break;
    }
    case kStepCopy:
      issue_copy(op, lane, *s.as<CopyStep>());
      break;
    case kStepReduce:
    case kStepReduceLocated:
      issue_reduce(op, lane, *s.as_reduction(), s.as<LocatedReduceStep>());
      break;
    case kStepCopyLocated:
      issue_located_copy(op, lane, *s.as<LocatedCopyStep>());
      break;
    case kStepAccumulate: {  // never to a routed peer: refused when the arena is created
      const AccumulateStep& a = *s.as<AccumulateStep>();
      prepare(op, lane);
      check(launch_accumulate(a.dst, a.src, a.numel, a.dtype, accumulate_blocks_, lanes_.stream(lane)),
            "launching the accumulation");
      break;
    }
    case kStepZero: {
      const ZeroStep& z = *s.as<ZeroStep>();
      prepare(op, lane);
      check(cudaMemsetAsync(z.dst, 0, z.bytes, lanes_.stream(lane)), "cudaMemsetAsync");
      break;
    }
  }
}

// A flag kernel on the lane: its pending signals, then (if any) the waits of `wait`. With stream
// memory operations the waits are those instead (no kernel, no SM: the signals went out at
// once), and a checked wait's descriptors are checked by a flag kernel behind them.
void CopyEngines::launch_flags(Issue& op, int lane, const WaitStep* wait) {
  lanes_.fork(lane);
  const StepRecording& r = op.r;
  if (wait && memops_) {
    for (int i = 0; i < wait->counters.n; ++i) {
      const int k = wait->counters.first + i;
      memops_.wait_geq(lanes_.stream(lane), r.counter(k), wait->target);
      op.waits.push_back(WatchedWait{r.counter(k), wait->target, r.peer(k), wait->site});
    }
    if (!wait->checked) return;
  }
  FlagOp f{};
  PendingSignals& p = pending_[lane];
  for (int b = 0; b < p.batches; ++b) {
    f.n_signal[b] = static_cast<int>(p.flags[b].size());
    std::copy(p.flags[b].begin(), p.flags[b].end(), f.signal[b]);
    f.signal_value[b] = p.value[b];
    f.payload[b] = p.payload[b];
  }
  if (wait) {
    f.n_wait = wait->counters.n;
    for (int i = 0; i < wait->counters.n; ++i) {
      const int k = wait->counters.first + i;
      f.wait[i] = r.counter(k);
      f.wait_peer[i] = r.peer(k);
      if (wait->checked) f.desc[i] = r.counter(k + wait->counters.n);
    }
    f.check = wait_check(*wait, op.env);
  }
  check(launch_flag_op(f, lanes_.stream(lane)), "launching a flag kernel");
  op.flagged[lane] = true;
  p = PendingSignals{};
}

void CopyEngines::prepare(Issue& op, int lane) {
  flush_signals(op, lane);
  lanes_.fork(lane);
}

void CopyEngines::issue_copy(Issue& op, int lane, const CopyStep& c) {
  prepare(op, lane);
  DeviceMemory& memory = op.env.memory;
  if (memory.routed(c.dst) || memory.routed(c.src)) {
    memory.copy_routed(ring_index(op.env.ring) * world_ + lane, c.dst, c.src, c.bytes,
                       lanes_.stream(lane));
    return;
  }
  check(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDeviceToDevice, lanes_.stream(lane)),
        "cudaMemcpyAsync");
}

// located: the step's sources are located (their Location words decide on the device,
// kernels.cuh); null: plain addresses.
void CopyEngines::issue_reduce(Issue& op, int lane, const ReduceStep& s,
                               const LocatedReduceStep* located) {
  prepare(op, lane);
  ReduceOpArgs args{};
  args.n_src = s.srcs.n;
  args.dst = s.dst;
  args.numel = s.numel;
  bool aligned = reinterpret_cast<uintptr_t>(s.dst) % 16 == 0;
  for (int i = 0; i < args.n_src; ++i) {
    args.src[i] = op.r.word(s.srcs.first + i);
    aligned = aligned && reinterpret_cast<uintptr_t>(args.src[i]) % 16 == 0;
  }
  if (located) {
    for (int i = 0; i < args.n_src; ++i) {
      args.where[i] = static_cast<const uint64_t*>(op.r.word(s.srcs.first + s.srcs.n + i));
    }
    args.segments = op.env.segments;
    args.located_offset = located->offset;
    args.elem_size = dtype_size(s.spec.dtype);
    args.err = op.env.err;
    args.op_seq = located->site.op_seq;
    args.op = located->site.op;
    aligned = aligned && located->offset % 16 == 0;
  }
  const ReduceSpec& spec = s.spec;
  // fp32 scale for the fp32-accumulated types (as ever), fp64 for float64
  args.scale = spec.dtype == DType::F64 ? spec.scale : static_cast<float>(spec.scale);
  args.scale_ptr = spec.scale_ptr;
  args.vectorized = aligned;
  // Bulk copies where sources lie across NVLink: there a block's loads are latency-bound
  // (about 51 against 73 GB/s per block, H100); from this GPU's memory the register kernel is
  // as fast or faster (reduce_kernels.cu).
  const bool bulk = spec.reads_peers && peers_on_other_gpus_;
  op.reduce_blocks = std::max(op.reduce_blocks, reduce_grid(args.numel, reduce_blocks_));
  check(launch_reduce(args, spec.dtype, spec.combine, reduce_blocks_, bulk, lanes_.stream(lane)),
        "launching the reduction");
}

// A located copy: an SM kernel of ODC_REDUCE_BLOCKS blocks at most (its source is known only
// on the device, after the owner's "ready").
void CopyEngines::issue_located_copy(Issue& op, int lane, const LocatedCopyStep& s) {
  prepare(op, lane);
  LocatedCopyOp c{};
  c.dst = s.dst;
  c.src = LocatedSrc{s.src.where, s.src.staged, s.src.offset, s.src.owner};
  c.bytes = s.bytes;
  c.segments = op.env.segments;
  c.err = op.env.err;
  c.op_seq = s.site.op_seq;
  c.op = s.site.op;
  op.reduce_blocks = std::max(op.reduce_blocks, reduce_blocks_);
  check(launch_located_copy(c, reduce_blocks_, lanes_.stream(lane)), "launching a located copy");
}

}  // namespace odc
