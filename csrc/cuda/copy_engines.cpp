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

CopyEngines::~CopyEngines() {
  if (guessed_done_) (void)cudaEventDestroy(guessed_done_);
}

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
  Issue op{r, env, std::vector<bool>(world_, false), std::vector<int>(world_, 0)};
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
  if (op.guess_hits) guessed_.done(env.stream);  // after the SM copies that read its hit words
  if (watchdog) {
    cudaEvent_t end = events.take();
    check(cudaEventRecord(end, env.stream), "recording an event");
    watchdog->track(start, end, std::move(op.waits), env.watch);
  }
  // The SMs it may hold at once: each lane's largest kernel (lanes run at once), and a flag
  // kernel per lane that ran one.
  int blocks = 0;
  for (int b : op.lane_blocks) blocks += b;
  return Transport::EngineUse{
      Transport::EngineUse::kCopyEngine,
      blocks + static_cast<int>(std::count(op.flagged.begin(), op.flagged.end(), true))};
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
    case kStepCopyLocated: {
      const LocatedCopyStep& c = *s.as<LocatedCopyStep>();
      issue_located_copy(op, lane, c.dst, c.src, false, c.bytes, c.site);
      break;
    }
    case kStepPushLocated:
      issue_push(op, lane, *s.as<LocatedPushStep>());
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
  op.lane_blocks[lane] = std::max(op.lane_blocks[lane], reduce_grid(args.numel, reduce_blocks_));
  check(launch_reduce(args, spec.dtype, spec.combine, reduce_blocks_, bulk, lanes_.stream(lane)),
        "launching the reduction");
}

// The operation's pushes with a guessed place (each after the wait on its lane), at the first
// of them: one graph on the operation's stream, after every signal issued before it ("ready"
// among them), and an event after it for the lanes.
void CopyEngines::launch_guessed(Issue& op) {
  const std::vector<Step>& steps = op.r.steps();
  std::vector<GuessedPuts::Put> puts;
  const WaitStep* first = nullptr;
  for (size_t i = 0; i < steps.size(); ++i) {
    const LocatedPushStep* s = steps[i].as<LocatedPushStep>();
    if (!s || !s->guess_at) continue;
    if (puts.size() == static_cast<size_t>(kMaxGatePeers)) break;  // one gate's: the rest SM copies
    const WaitStep* w = nullptr;  // the wait before it on its lane
    for (size_t j = i; j-- > 0 && !w;) {
      if (steps[j].lane == steps[i].lane) w = steps[j].as<WaitStep>();
    }
    if (!w || w->counters.n != 1 || (first && (w->target != first->target || w->desc != first->desc ||
                                               w->checked != first->checked))) {
      throw std::logic_error("odc: guessed pushes wait for one peer each, for the same number");
    }
    first = first ? first : w;
    puts.push_back({s->guess_at, s->src, s->bytes, op.r.counter(w->counters.first),
                    w->checked ? op.r.counter(w->counters.first + 1) : nullptr,
                    op.r.peer(w->counters.first), s->dst.where, s->guess});
    op.guessed.push_back(s);
  }
  flush_all_signals(op);
  op.guess_serial = ++guess_serial_;
  op.guess_hits = guessed_.launch(op.env.stream, puts, wait_check(*first, op.env), op.guess_serial);
  if (!guessed_done_) check(cudaEventCreateWithFlags(&guessed_done_, cudaEventDisableTiming), "creating an event");
  check(cudaEventRecord(guessed_done_, op.env.stream), "recording an event");
}

// A push: with a guess of the destination, a copy engine's copy behind a gate that checks it
// (launch_guessed), then the SM copy, which writes only where the guess missed.
void CopyEngines::issue_push(Issue& op, int lane, const LocatedPushStep& s) {
  Located to = s.dst;
  to.staged = nullptr;  // a peer whose output is not mapped here: nothing to write
  const uint64_t* hit = nullptr;
  if (s.guess_at && !op.guess_hits) launch_guessed(op);
  const size_t k = std::find(op.guessed.begin(), op.guessed.end(), &s) - op.guessed.begin();
  if (k < op.guessed.size()) {  // among the graph's (not past one gate's kMaxGatePeers)
    prepare(op, lane);
    check(cudaStreamWaitEvent(lanes_.stream(lane), guessed_done_, 0), "waiting for an event");
    hit = op.guess_hits + k;
  }
  issue_located_copy(op, lane, const_cast<void*>(s.src), to, true, s.bytes, s.site, hit, op.guess_serial);
}

// A located copy or push: an SM kernel of ODC_REDUCE_BLOCKS blocks at most (the peer's address
// is known only on the device, after its "ready"). With `hit`, its blocks leave at once where
// the guessed push copied already: it then holds no SM for long (counted as the gate's one).
void CopyEngines::issue_located_copy(Issue& op, int lane, void* local, const Located& far,
                                     bool push, size_t bytes, const WaitSite& site,
                                     const uint64_t* hit, uint64_t serial) {
  prepare(op, lane);
  LocatedCopyOp c{};
  c.local = local;
  c.far = LocatedRef{far.where, far.staged, far.offset, far.owner};
  c.push = push;
  c.hit = hit;
  c.serial = serial;
  c.bytes = bytes;
  c.segments = op.env.segments;
  c.err = op.env.err;
  c.op_seq = site.op_seq;
  c.op = site.op;
  op.lane_blocks[lane] = std::max(op.lane_blocks[lane], hit ? 1 : located_grid(bytes, reduce_blocks_));
  check(launch_located_copy(c, reduce_blocks_, lanes_.stream(lane)), "launching a located copy");
}

}  // namespace odc
