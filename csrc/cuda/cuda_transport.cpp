// Layer 2, a transport: the CUDA transport (cuda_transport.hpp).
#include "cuda_transport.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace odc {
namespace {

// Makes `dev` current for the scope; no driver call where it already is (the usual case).
struct DeviceGuard {
  int prev = 0;
  bool switched = false;
  explicit DeviceGuard(int dev) {
    check(cudaGetDevice(&prev), "cudaGetDevice");
    switched = prev != dev;
    if (switched) check(cudaSetDevice(dev), "cudaSetDevice");
  }
  ~DeviceGuard() {
    if (switched) (void)cudaSetDevice(prev);
  }
};

}  // namespace

CudaIpcTransport::CudaIpcTransport(const TransportArgs& args, int device, int reduce_blocks,
                                   int accumulate_blocks, size_t small_op_bytes, int fused_blocks,
                                   int ranks_on_gpu, bool stream_memops, bool peers_on_other_gpus,
                                   std::unique_ptr<DeviceMemory> memory)
    : a_(args),
      device_(device),
      memory_(memory ? std::move(memory) : make_ipc_memory(device)),
      reduce_blocks_(reduce_blocks),
      peers_on_other_gpus_(peers_on_other_gpus),
      accumulate_blocks_(accumulate_blocks),
      small_op_bytes_(small_op_bytes),
      fused_blocks_(fused_blocks),
      bases_(args.world, nullptr) {
  if (a_.world > kMaxPeers) {
    throw std::runtime_error("odc: the CUDA IPC transport supports groups of at most " +
                             std::to_string(kMaxPeers) + " ranks");
  }
  DeviceGuard g(device_);
  check(preload_kernels(), "loading the transport's kernels");
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_), "counting SMs");
  // Two collectives may run at once (FSDP's all-gather and reduce-scatter streams).
  fused_blocks_ = std::max(1, std::min(fused_blocks_, sms / (2 * std::max(1, ranks_on_gpu))));
  const size_t arrival_bytes = sizeof(unsigned) * kFusedArrivalsPerOp * kNumRings;
  check(cudaMalloc(reinterpret_cast<void**>(&arrivals_), arrival_bytes), "allocating the fused kernel's counters");
  check(cudaMemset(arrivals_, 0, arrival_bytes), "zeroing the fused kernel's counters");
  bases_ = memory_->open(a_, "ipc", a_.layout.total, "communication window");
  check(cudaHostAlloc(reinterpret_cast<void**>(&err_host_), sizeof(DeviceError),
                      cudaHostAllocMapped),
        "allocating the error record");
  std::memset(err_host_, 0, sizeof(DeviceError));
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&err_dev_), err_host_, 0),
        "mapping the error record");
  pending_.assign(a_.world, PendingSignals{});
  lane_used_.assign(a_.world, false);
  if (stream_memops) load_memops();
  if (wait_value_) {
    check(cudaStreamCreateWithFlags(&wd_stream_, cudaStreamNonBlocking), "creating a stream");
    // Self-test on counters that are still zero: a store of 0 into each peer's
    // window through its IPC mapping and a wait on our own. Where either is refused,
    // fall back to flag kernels.
    const CUstream s = reinterpret_cast<CUstream>(wd_stream_);
    bool ok = wait_value_(s, reinterpret_cast<CUdeviceptr>(bases_[a_.rank]), 0,
                          CU_STREAM_WAIT_VALUE_GEQ) == CUDA_SUCCESS;
    for (int r = 0; ok && r < a_.world; ++r) {
      if (memory_->routed(bases_[r])) continue;  // a placeholder address
      ok = write_value_(s, reinterpret_cast<CUdeviceptr>(bases_[r]), 0,
                        CU_STREAM_WRITE_VALUE_DEFAULT) == CUDA_SUCCESS;
    }
    ok = ok && cudaStreamSynchronize(wd_stream_) == cudaSuccess;
    if (!ok) {
      (void)cudaGetLastError();
      wait_value_ = nullptr;
      write_value_ = nullptr;
    }
  }
  // No peer may signal into a window before its owner has zeroed it and every
  // peer has opened it.
  store_barrier(a_, "ipc_open");
  // Last: a constructor that throws after this would destroy a joinable thread.
  if (wait_value_) watchdog_ = std::thread([this] { watchdog_loop(); });
}

// Stream memory operations come from the driver API, looked up at run time so the
// extension links against the runtime only.
void CudaIpcTransport::load_memops() {
  using AttrFn = CUresult (*)(int*, CUdevice_attribute, CUdevice);
  void* attr_fn = nullptr;
  void* wait_fn = nullptr;
  void* write_fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion("cuDeviceGetAttribute", &attr_fn, 12000, cudaEnableDefault,
                                       &q) != cudaSuccess || q != cudaDriverEntryPointSuccess ||
      cudaGetDriverEntryPointByVersion("cuStreamWaitValue64", &wait_fn, 12000, cudaEnableDefault,
                                       &q) != cudaSuccess || q != cudaDriverEntryPointSuccess ||
      cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &write_fn, 12000,
                                       cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return;  // an old driver: flag kernels
  }
  int ok = 0;
  if (reinterpret_cast<AttrFn>(attr_fn)(&ok, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
                                        device_) != CUDA_SUCCESS || !ok) {
    return;
  }
  wait_value_ = reinterpret_cast<WaitValueFn>(wait_fn);
  write_value_ = reinterpret_cast<WriteValueFn>(write_fn);
}

EventPool::~EventPool() {
  for (cudaEvent_t ev : free_) (void)cudaEventDestroy(ev);
}

cudaEvent_t EventPool::take() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!free_.empty()) {
      cudaEvent_t ev = free_.back();
      free_.pop_back();
      return ev;
    }
  }
  cudaEvent_t ev;
  check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "creating an event");
  return ev;
}

void EventPool::give(cudaEvent_t ev) {
  std::lock_guard<std::mutex> lk(mu_);
  free_.push_back(ev);
}

std::shared_ptr<void> EventPool::share(cudaEvent_t ev) {
  return std::shared_ptr<void>(ev, [pool = shared_from_this()](void* e) {
    pool->give(static_cast<cudaEvent_t>(e));
  });
}

// Polls the tracked operations. An operation counts as started once the GPU has
// reached it (its start event completed); if it is still unfinished a group timeout
// later, its first unmet wait names the peer, the error is recorded for the next
// call to raise, and every counter of this rank's window is set past any target so
// that the queued work drains instead of hanging the process.
void CudaIpcTransport::watchdog_loop() {
  (void)cudaSetDevice(device_);
  std::unique_lock<std::mutex> lk(wd_mu_);
  bool released = false;
  while (!wd_stop_) {
    wd_cv_.wait_for(lk, std::chrono::milliseconds(20));
    const auto now = std::chrono::steady_clock::now();
    for (auto it = tracked_.begin(); it != tracked_.end();) {
      if (cudaEventQuery(it->end) == cudaSuccess) {
        events_->give(it->start);
        events_->give(it->end);
        it = tracked_.erase(it);
        continue;
      }
      if (!it->started && cudaEventQuery(it->start) == cudaSuccess) {
        it->started = true;
        it->started_at = now;
      }
      if (it->started && !released && it->watch.slots && now - it->started_at > kWatchAfter &&
          announced_other(*it)) {
        released = diagnose_and_release(*it);  // the error is recorded: releases everything
      } else if (it->started && !released && now - it->started_at > a_.timeout()) {
        released = diagnose_and_release(*it);
        if (!released) it->started_at = now;  // its waits are met: slow, not stuck
      } else if (released) {
        // A late peer may still store a smaller counter value: keep releasing
        // until every tracked operation has drained.
        (void)diagnose_and_release(*it);
      }
      ++it;
    }
    (void)cudaGetLastError();  // cudaErrorNotReady from the queries
  }
}

// Stream memory operations cannot watch the peers' announcements themselves (PeerWatch):
// the watchdog reads the slots of the peers an unfinished operation waits for, and
// records a peer that announced another collective at this point.
bool CudaIpcTransport::announced_other(const Tracked& op) {
  for (const WaitRec& w : op.waits) {
    uint64_t theirs = 0;
    if (cudaMemcpyAsync(&theirs, op.watch.slot_of(w.peer), sizeof(theirs), cudaMemcpyDeviceToHost,
                        wd_stream_) != cudaSuccess ||
        cudaStreamSynchronize(wd_stream_) != cudaSuccess) {
      return false;
    }
    if (!op.watch.differs(theirs)) continue;
    volatile DeviceError* e = err_host_;
    if (e->code == 0) {
      e->peer = w.peer;
      e->op_seq = w.site.op_seq;
      e->mine = op.watch.word;
      e->theirs = theirs;
      e->op = w.site.op;
      e->what = w.site.what;
      std::atomic_thread_fence(std::memory_order_seq_cst);
      e->code = 3;
    }
    return true;
  }
  return false;
}

bool CudaIpcTransport::diagnose_and_release(const Tracked& op) {
  // Each awaited counter is read on its own: it may live in the window or in an arena.
  const uint64_t released = uint64_t{1} << 62;
  bool unmet = err_host_->code != 0;  // already failed: keep releasing
  std::vector<const uint64_t*> stuck;
  for (const WaitRec& w : op.waits) {
    uint64_t seen = 0;
    if (cudaMemcpyAsync(&seen, w.flag, sizeof(seen), cudaMemcpyDeviceToHost, wd_stream_) !=
            cudaSuccess ||
        cudaStreamSynchronize(wd_stream_) != cudaSuccess) {
      return false;
    }
    if (seen >= w.target) continue;
    unmet = true;
    stuck.push_back(w.flag);
    volatile DeviceError* e = err_host_;
    if (e->code == 0) {
      e->peer = w.peer;
      e->op_seq = w.site.op_seq;
      e->target = w.target;
      e->seen = seen;
      e->op = w.site.op;
      e->what = w.site.what;
      std::atomic_thread_fence(std::memory_order_seq_cst);
      e->code = 1;
    }
  }
  if (!unmet) return false;
  // Release: every counter of the window, and each stuck one elsewhere, far beyond any
  // target (the group is unusable from now on).
  const size_t flag_bytes = a_.layout.flags_bytes;  // the window's counters come first
  std::vector<uint64_t> counters(flag_bytes / sizeof(uint64_t), released);
  (void)cudaMemcpyAsync(bases_[a_.rank], counters.data(), flag_bytes, cudaMemcpyHostToDevice,
                        wd_stream_);
  for (const uint64_t* f : stuck) {
    (void)cudaMemcpyAsync(const_cast<uint64_t*>(f), &released, sizeof(released),
                          cudaMemcpyHostToDevice, wd_stream_);
  }
  (void)cudaStreamSynchronize(wd_stream_);
  return true;
}

int CudaIpcTransport::create_arena(size_t bytes) {
  DeviceGuard g(device_);
  const int id = static_cast<int>(arenas_.size());
  arenas_.push_back(memory_->open(a_, "ipc_arena" + std::to_string(id), bytes, "arena"));
  arena_bytes_.push_back(bytes);
  // No peer may signal into an arena before its owner has zeroed it.
  store_barrier(a_, "ipc_arena_open" + std::to_string(id));
  return id;
}

CudaIpcTransport::~CudaIpcTransport() {
  int prev = 0;
  const bool switched = cudaGetDevice(&prev) == cudaSuccess && cudaSetDevice(device_) == cudaSuccess;
  (void)cudaDeviceSynchronize();  // the watchdog still releases a stuck wait meanwhile
  if (watchdog_.joinable()) {
    {
      std::lock_guard<std::mutex> lk(wd_mu_);
      wd_stop_ = true;
    }
    wd_cv_.notify_all();
    watchdog_.join();
  }
  for (auto& t : tracked_) {
    (void)cudaEventDestroy(t.start);
    (void)cudaEventDestroy(t.end);
  }
  for (auto& ev : ring_done_) ev.reset();
  last_done_.reset();
  for (auto& [key, g] : put_graphs_) destroy(g);
  for (auto& g : retired_puts_) destroy(g);
  if (wd_stream_) (void)cudaStreamDestroy(wd_stream_);
  for (auto& [stream, l] : lanes_) {
    for (auto s : l.side) (void)cudaStreamDestroy(s);
    for (auto ev : l.join) (void)cudaEventDestroy(ev);
    (void)cudaEventDestroy(l.fork);
  }
  memory_->close(a_, bases_);
  for (auto& a : arenas_) memory_->close(a_, a);
  if (err_host_) (void)cudaFreeHost(err_host_);
  if (arrivals_) (void)cudaFree(arrivals_);
  if (switched) (void)cudaSetDevice(prev);
}

CudaIpcTransport::Lanes& CudaIpcTransport::lanes_for(cudaStream_t stream) {
  for (auto& [s, l] : lanes_) {
    if (s == stream) return l;
  }
  Lanes l;
  int lo = 0, hi = 0;
  check(cudaDeviceGetStreamPriorityRange(&lo, &hi), "stream priorities");
  for (int i = 1; i < a_.world; ++i) {
    cudaStream_t s;
    cudaEvent_t ev;
    check(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, hi), "creating a lane stream");
    check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "creating an event");
    l.side.push_back(s);
    l.join.push_back(ev);
  }
  check(cudaEventCreateWithFlags(&l.fork, cudaEventDisableTiming), "creating an event");
  lanes_.emplace_back(stream, std::move(l));
  return lanes_.back().second;
}

void CudaIpcTransport::begin_op(void* stream, Ring ring) {
  op_stream_ = static_cast<cudaStream_t>(stream);
  ring_ = ring;
  last_done_.reset();
  last_use_ = EngineUse{};
  steps_.clear();
  ptrs_.clear();
  peers_.clear();
}

// ---- Recording: the protocol's calls become steps, run at end_op.

void CudaIpcTransport::wait(int lane, const std::vector<const uint64_t*>& flags,
                            const std::vector<int>& peers, uint64_t target,
                            const WaitSite& site, const DescCheck* check) {
  Step s{kStepWait, lane, static_cast<int>(ptrs_.size()), static_cast<int>(flags.size()),
         target, check ? check->expected : 0, check ? check->id : 0, nullptr, nullptr, {}, site};
  ptrs_.insert(ptrs_.end(), flags.begin(), flags.end());
  peers_.insert(peers_.end(), peers.begin(), peers.end());
  if (check) {  // the descriptors follow the counters (peers_ stays parallel to ptrs_)
    ptrs_.insert(ptrs_.end(), check->descs.begin(), check->descs.end());
    peers_.insert(peers_.end(), peers.begin(), peers.end());
  }
  steps_.push_back(s);
}

void CudaIpcTransport::signal(int lane, const std::vector<uint64_t*>& flags, uint64_t value) {
  Step s{kStepSignal, lane, static_cast<int>(ptrs_.size()), static_cast<int>(flags.size()),
         value, 0, 0, nullptr, nullptr, {}, {}};
  ptrs_.insert(ptrs_.end(), flags.begin(), flags.end());
  peers_.resize(ptrs_.size(), -1);
  steps_.push_back(s);
}

void CudaIpcTransport::store(int lane, const std::vector<uint64_t*>& words, uint64_t value) {
  signal(lane, words, value);
  steps_.back().kind = kStepStore;
}

void CudaIpcTransport::copy(int lane, void* dst, const void* src, size_t bytes) {
  steps_.push_back(Step{kStepCopy, lane, 0, 0, bytes, 0, 0, dst, src, {}, {}});
}

void CudaIpcTransport::accumulate(int lane, float* dst, const void* src, size_t numel,
                                  DType dtype) {
  ReduceSpec spec;
  spec.dtype = dtype;
  steps_.push_back(Step{kStepAccumulate, lane, 0, 0, numel, 0, 0, dst, src, spec, {}});
}

void CudaIpcTransport::fill_zero(int lane, void* dst, size_t bytes) {
  steps_.push_back(Step{kStepZero, lane, 0, 0, bytes, 0, 0, dst, nullptr, {}, {}});
}

void CudaIpcTransport::reduce(int lane, void* dst, const std::vector<const void*>& srcs,
                              size_t numel, const ReduceSpec& spec) {
  Step s{kStepReduce, lane, static_cast<int>(ptrs_.size()), static_cast<int>(srcs.size()),
         numel, 0, 0, dst, nullptr, spec, {}};
  ptrs_.insert(ptrs_.end(), srcs.begin(), srcs.end());
  peers_.resize(ptrs_.size(), -1);
  steps_.push_back(s);
}

void CudaIpcTransport::end_op() {
  DeviceGuard g(device_);
  if (steps_.empty()) return;
  // A ring's chunk counters assume its operations run in issue order: one issued on
  // another stream than the previous one on this ring first waits for that one.
  auto event = [](const std::shared_ptr<void>& e) { return static_cast<cudaEvent_t>(e.get()); };
  if (ring_done_[ring_] && ring_stream_[ring_] != op_stream_) {
    check(cudaStreamWaitEvent(op_stream_, event(ring_done_[ring_]), 0), "ordering after the ring's last op");
  }
  if (ring_ == kArenaSyncRing) {
    // A minibatch's sync (Done signals, taking the accumulators) comes after every
    // accumulate and get issued before it, whatever streams FSDP issued them on.
    for (Ring r : {kArenaPutRing, kArenaGetRing}) {
      if (ring_done_[r] && ring_stream_[r] != op_stream_) {
        check(cudaStreamWaitEvent(op_stream_, event(ring_done_[r]), 0), "ordering the sync");
      }
    }
  }
  if (fusable()) {
    run_fused();
  } else {
    run_on_copy_engines();
  }
  // A new event per op (a Work may still hold the last one: completion()); the pool
  // recycles them.
  ring_done_[ring_] = events_->share(events_->take());
  check(cudaEventRecord(event(ring_done_[ring_]), op_stream_), "recording the ring's last op");
  ring_stream_[ring_] = op_stream_;
  last_done_ = ring_done_[ring_];
}

std::shared_ptr<void> CudaIpcTransport::completion(void* stream, bool after_last_op) {
  if (after_last_op && last_done_ && ring_stream_[ring_] == stream) return last_done_;
  DeviceGuard g(device_);
  std::shared_ptr<void> done = events_->share(events_->take());
  check(cudaEventRecord(static_cast<cudaEvent_t>(done.get()), static_cast<cudaStream_t>(stream)),
        "recording a collective's end");
  return done;
}

// ---- The fused engine.

bool CudaIpcTransport::fusable() {
  if (small_op_bytes_ == 0 || memory_->any_routed() || a_.world > kFusedMaxLanes ||
      steps_.size() > static_cast<size_t>(kFusedMaxSteps) ||
      ptrs_.size() > static_cast<size_t>(kFusedMaxPtrs)) {
    return false;
  }
  for (const Step& s : steps_) {
    if (s.kind == kStepAccumulate || s.kind == kStepZero) return false;
    if (s.kind == kStepCopy && s.value > small_op_bytes_) return false;
    if (s.kind == kStepReduce &&
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
bool CudaIpcTransport::plan_fused_blocks() {
  int lanes_with_data = 0, lanes_without = 0;
  size_t bytes[kFusedMaxLanes] = {};  // fusable() checked world <= kFusedMaxLanes
  bool has_steps[kFusedMaxLanes] = {};
  for (const Step& s : steps_) {
    const size_t b = s.kind == kStepCopy     ? s.value
                     : s.kind == kStepReduce ? s.value * dtype_size(s.spec.dtype) * s.n
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

void CudaIpcTransport::run_fused() {
  FusedOp op{};
  op.lanes = a_.world;
  op.timeout_ns = static_cast<unsigned long long>(a_.timeout().count()) * 1000000ull;
  op.err = err_dev_;
  op.watch_slots = watch_.slots;
  op.watch_word = watch_.word;
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

// ---- The copy-engine engine: each lane on its own stream, forked from and joined
// back to the operation's stream.

void CudaIpcTransport::run_on_copy_engines() {
  std::vector<PutRun> puts;  // each run of puts with its graph, made before anything is enqueued
  for (size_t i = 0; i < steps_.size(); ++i) {
    if (!steps_[i].guarded) continue;
    if (puts.empty()) retire_puts();
    size_t end = i;
    while (end < steps_.size() && steps_[end].guarded) ++end;
    puts.push_back(prepare_puts(i, end));
    i = end - 1;
  }
  size_t next_puts = 0;
  // Data on one lane only (a zero-copy all-gather of 2 ranks, any zero-copy reduce-scatter):
  // nothing to overlap, so every lane runs on the operation's stream in issue order (which
  // is deadlock-free, see below). Fewer launches and no fork or join; waits and signals of
  // one point share a flag kernel.
  int data_lane = -1;
  bool one_data_lane = !memory_->any_routed();
  for (const Step& s : steps_) {
    if (s.kind == kStepWait || s.kind == kStepSignal || s.kind == kStepStore) continue;
    if (data_lane >= 0 && s.lane != data_lane) one_data_lane = false;
    data_lane = s.lane;
  }
  if (one_data_lane) {
    for (Step& s : steps_) s.lane = 0;
  }
  cur_ = &lanes_for(op_stream_);
  cudaEvent_t start = nullptr;
  if (wait_value_) {
    start = events_->take();
    check(cudaEventRecord(start, op_stream_), "recording an event");
    op_waits_.clear();
  }
  if (!one_data_lane) check(cudaEventRecord(cur_->fork, op_stream_), "recording the fork event");
  std::fill(lane_used_.begin(), lane_used_.end(), false);
  flagged_.assign(a_.world, false);
  ce_reduce_blocks_ = 0;
  std::vector<uint64_t*> sigs;
  std::vector<const void*> srcs;
  for (size_t i = 0; i < steps_.size(); ++i) {
    const Step& s = steps_[i];
    if (s.guarded) {  // a run of puts: one graph on the op stream
      size_t end = i;
      while (end < steps_.size() && steps_[end].guarded) ++end;
      issue_puts(puts[next_puts++]);
      i = end - 1;
      continue;
    }
    switch (s.kind) {
      case kStepWait:
        // Signals issued on other lanes before this wait go out first. Streams may share a
        // hardware queue (few connections per process, fewer under MPS), and a queue runs
        // in order: a signal held back behind this wait could then wait for it, and two
        // ranks would wait for each other. Issue order itself is deadlock-free (the
        // protocol's chunk-major order), so keeping every queue in issue order is too.
        for (int lane = 0; lane < a_.world; ++lane) {
          if (lane != s.lane) flush_signals(lane);
        }
        launch_flags(s.lane, &s);
        break;
      case kStepSignal:
      case kStepStore:
        sigs.clear();
        for (int i = 0; i < s.n; ++i) {
          sigs.push_back(static_cast<uint64_t*>(const_cast<void*>(ptrs_[s.first + i])));
        }
        issue_signal(s.lane, sigs, s.value, /*payload=*/s.kind == kStepStore);
        break;
      case kStepCopy:
        issue_copy(s.lane, s.dst, s.src, s.value);
        break;
      case kStepReduce:
        srcs.assign(ptrs_.begin() + s.first, ptrs_.begin() + s.first + s.n);
        issue_reduce(s.lane, s.dst, srcs, s.value, s.spec);
        break;
      case kStepAccumulate:  // never to a routed peer: refused when the arena is created
        issue_prepare(s.lane);
        check(launch_accumulate(static_cast<float*>(s.dst), s.src, s.value, s.spec.dtype,
                                accumulate_blocks_, lane_stream(s.lane)),
              "launching the accumulation");
        break;
      case kStepZero:
        issue_prepare(s.lane);
        check(cudaMemsetAsync(s.dst, 0, s.value, lane_stream(s.lane)), "cudaMemsetAsync");
        break;
    }
  }
  for (int lane = 0; lane < a_.world; ++lane) flush_signals(lane);
  // The SMs it may hold at once: its largest reduction, and a flag kernel per lane that ran one.
  last_use_ = EngineUse{EngineUse::kCopyEngine,
                        ce_reduce_blocks_ + static_cast<int>(std::count(flagged_.begin(), flagged_.end(), true))};
  for (int lane = 1; lane < a_.world; ++lane) {
    if (!lane_used_[lane]) continue;
    check(cudaEventRecord(cur_->join[lane - 1], cur_->side[lane - 1]), "recording a join event");
    check(cudaStreamWaitEvent(op_stream_, cur_->join[lane - 1], 0), "joining a lane");
  }
  if (wait_value_) {
    Tracked t;
    t.start = start;
    t.end = events_->take();
    check(cudaEventRecord(t.end, op_stream_), "recording an event");
    t.waits = std::move(op_waits_);
    t.watch = watch_;
    op_waits_ = {};
    std::lock_guard<std::mutex> lk(wd_mu_);
    tracked_.push_back(std::move(t));
  }
}

cudaStream_t CudaIpcTransport::lane_stream(int lane) const {
  return lane == 0 ? op_stream_ : cur_->side[lane - 1];
}

void CudaIpcTransport::launch_flags(int lane, const Step* wait) {
  fork_lane(lane);
  if (wait && wait_value_) {  // stream memory operations: no kernel, no SM (signals went out at once)
    const CUstream s = reinterpret_cast<CUstream>(lane_stream(lane));
    for (int i = 0; i < wait->n; ++i) {
      const auto* flag = static_cast<const uint64_t*>(ptrs_[wait->first + i]);
      if (wait_value_(s, reinterpret_cast<CUdeviceptr>(flag), wait->value,
                      CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS) {
        throw std::runtime_error("odc: cuStreamWaitValue64 failed");
      }
      op_waits_.push_back(WaitRec{flag, wait->value, peers_[wait->first + i], wait->site});
    }
    if (!wait->desc) return;
    // The descriptors are checked by a flag kernel behind those waits (met by then).
  }
  FlagOp op{};
  PendingSignals& p = pending_[lane];
  for (int b = 0; b < p.batches; ++b) {
    op.n_signal[b] = static_cast<int>(p.flags[b].size());
    std::copy(p.flags[b].begin(), p.flags[b].end(), op.signal[b]);
    op.signal_value[b] = p.value[b];
    op.payload[b] = p.payload[b];
  }
  if (wait) {
    op.n_wait = wait->n;
    for (int i = 0; i < wait->n; ++i) {
      op.wait[i] = static_cast<const uint64_t*>(ptrs_[wait->first + i]);
      op.wait_peer[i] = peers_[wait->first + i];
      if (wait->desc) op.desc[i] = static_cast<const uint64_t*>(ptrs_[wait->first + wait->n + i]);
    }
    op.wait_target = wait->value;
    op.desc_expected = wait->desc;
    op.desc_id = wait->desc_id;
    op.op_seq = wait->site.op_seq;
    op.op = wait->site.op;
    op.what = wait->site.what;
  }
  op.timeout_ns = static_cast<unsigned long long>(a_.timeout().count()) * 1000000ull;
  op.err = err_dev_;
  if (wait) {
    op.watch_slots = watch_.slots;
    op.watch_word = watch_.word;
  }
  check(launch_flag_op(op, lane_stream(lane)), "launching a flag kernel");
  flagged_[lane] = true;
  p = PendingSignals{};
}

void CudaIpcTransport::flush_signals(int lane) {
  if (pending_[lane].batches > 0) launch_flags(lane, nullptr);
}

void CudaIpcTransport::issue_signal(int lane, const std::vector<uint64_t*>& flags,
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

void CudaIpcTransport::issue_direct_signal(int lane, const std::vector<uint64_t*>& flags,
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
void CudaIpcTransport::issue_prepare(int lane) {
  flush_signals(lane);
  fork_lane(lane);
}

// A side lane's first step of an operation waits for everything before the operation.
void CudaIpcTransport::fork_lane(int lane) {
  if (lane > 0 && !lane_used_[lane]) {
    check(cudaStreamWaitEvent(lane_stream(lane), cur_->fork, 0), "forking a lane");
    lane_used_[lane] = true;
  }
}

void CudaIpcTransport::issue_copy(int lane, void* dst, const void* src, size_t bytes) {
  issue_prepare(lane);
  if (memory_->routed(dst) || memory_->routed(src)) {
    memory_->copy_routed(static_cast<int>(ring_) * a_.world + lane, dst, src, bytes,
                         lane_stream(lane));
    return;
  }
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, lane_stream(lane)),
        "cudaMemcpyAsync");
}

void CudaIpcTransport::issue_reduce(int lane, void* dst, const std::vector<const void*>& srcs,
                                    size_t numel, const ReduceSpec& spec) {
  issue_prepare(lane);
  ReduceOpArgs r{};
  r.n_src = static_cast<int>(srcs.size());
  bool aligned = reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  for (int i = 0; i < r.n_src; ++i) {
    r.src[i] = srcs[i];
    aligned = aligned && reinterpret_cast<uintptr_t>(srcs[i]) % 16 == 0;
  }
  r.dst = dst;
  r.numel = numel;
  // fp32 scale for the fp32-accumulated types (as ever), fp64 for float64
  r.scale = spec.dtype == DType::F64 ? spec.scale : static_cast<float>(spec.scale);
  r.scale_ptr = spec.scale_ptr;
  r.vectorized = aligned;
  // Bulk copies where sources lie across NVLink: there a block's loads are latency-bound
  // (about 51 against 73 GB/s per block, H100); from this GPU's memory the register kernel is
  // as fast or faster (kernels.cu).
  const bool bulk = spec.reads_peers && peers_on_other_gpus_;
  ce_reduce_blocks_ = std::max(ce_reduce_blocks_, reduce_grid(numel, reduce_blocks_));
  check(launch_reduce(r, spec.dtype, spec.combine, reduce_blocks_, bulk, lane_stream(lane)),
        "launching the reduction");
}

std::string CudaIpcTransport::async_error() {
  volatile DeviceError* e = err_host_;
  const int code = e->code;
  if (code == 0) return {};
  std::atomic_thread_fence(std::memory_order_acquire);  // the fields were written before code
  const char* op = e->op;
  const char* what = e->what;
  WaitSite site{op ? op : "collective", what ? what : "a counter of", e->op_seq};
  const std::string text =
      code == 3   ? describe_announced(site, a_.rank, e->peer, e->mine, e->theirs)
      : code == 2 ? describe_mismatch(site, a_.rank, e->peer, e->mine, e->theirs, e->target, e->seen)
                  : describe_wait(site, e->peer, e->target, e->seen, a_.timeout());
  return text + " (detected on the GPU; results of this and later collectives are invalid)";
}

}  // namespace odc
