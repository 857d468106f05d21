// Layer 2, a transport: the CUDA transport (cuda_transport.hpp): its set-up and teardown, its
// lanes, the recording of an operation's steps and the choice of the engine that runs them
// (fused_engine.cpp, copy_engine.cpp). Beside it: the event pool, the watchdog, signal issue,
// puts, and the kernels (kernels.cu).
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

CudaTransport::CudaTransport(const TransportArgs& args, const CudaTransportOptions& o,
                             std::unique_ptr<DeviceMemory> memory)
    : a_(args),
      device_(o.device),
      memory_(std::move(memory)),
      reduce_blocks_(o.reduce_blocks),
      peers_on_other_gpus_(o.peers_on_other_gpus),
      accumulate_blocks_(o.accumulate_blocks),
      small_op_bytes_(o.small_op_bytes),
      fused_blocks_(o.fused_blocks),
      bases_(args.world, nullptr) {
  if (a_.world > kMaxPeers) {
    throw std::runtime_error("odc: the CUDA transport supports groups of at most " +
                             std::to_string(kMaxPeers) + " ranks");
  }
  DeviceGuard g(device_);
  check(preload_kernels(), "loading the transport's kernels");
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_), "counting SMs");
  // Two collectives may run at once (FSDP's all-gather and reduce-scatter streams).
  fused_blocks_ = std::max(1, std::min(fused_blocks_, sms / (2 * std::max(1, o.ranks_on_gpu))));
  const size_t arrival_bytes = sizeof(unsigned) * kFusedArrivalsPerOp * kNumRings;
  check(cudaMalloc(reinterpret_cast<void**>(&arrivals_), arrival_bytes), "allocating the fused kernel's counters");
  check(cudaMemset(arrivals_, 0, arrival_bytes), "zeroing the fused kernel's counters");
  bases_ = memory_->open(a_, "ipc", a_.layout.total, "communication window");
  if (o.zero_copy) segments_ = std::make_unique<SegmentTable>(a_, device_);
  check(cudaHostAlloc(reinterpret_cast<void**>(&err_host_), sizeof(DeviceError),
                      cudaHostAllocMapped),
        "allocating the error record");
  std::memset(err_host_, 0, sizeof(DeviceError));
  for (int p = 0; p < a_.world; ++p) {  // where a failure is told to the peers (DeviceError)
    if (p != a_.rank && !memory_->routed(bases_[p])) {
      err_host_->notify[err_host_->n_notify++] =
          reinterpret_cast<uint64_t*>(bases_[p] + a_.layout.announce_slot(a_.rank, 0));
    }
  }
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&err_dev_), err_host_, 0),
        "mapping the error record");
  pending_.assign(a_.world, PendingSignals{});
  lane_used_.assign(a_.world, false);
  if (o.stream_memops) load_memops();
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
void CudaTransport::load_memops() {
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

int CudaTransport::create_arena(size_t bytes) {
  DeviceGuard g(device_);
  const int id = static_cast<int>(arenas_.size());
  arenas_.push_back(memory_->open(a_, "ipc_arena" + std::to_string(id), bytes, "arena"));
  arena_bytes_.push_back(bytes);
  // No peer may signal into an arena before its owner has zeroed it.
  store_barrier(a_, "ipc_arena_open" + std::to_string(id));
  return id;
}

CudaTransport::~CudaTransport() {
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
  segments_.reset();  // its mappings and table belong to this device
  if (switched) (void)cudaSetDevice(prev);
}

CudaTransport::Lanes& CudaTransport::lanes_for(cudaStream_t stream) {
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

void CudaTransport::begin_op(void* stream, Ring ring) {
  op_stream_ = static_cast<cudaStream_t>(stream);
  ring_ = ring;
  also_ = kNumRings;
  last_done_.reset();
  last_use_ = EngineUse{};
  steps_.clear();
  ptrs_.clear();
  peers_.clear();
  if (segments_) {  // the peers' segments shared since the last operation (host work only)
    DeviceGuard g(device_);
    segments_->refresh();
  }
}

// ---- Recording: the protocol's calls become steps, run at end_op.

void CudaTransport::wait(int lane, const std::vector<const uint64_t*>& flags,
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

void CudaTransport::signal(int lane, const std::vector<uint64_t*>& flags, uint64_t value) {
  Step s{kStepSignal, lane, static_cast<int>(ptrs_.size()), static_cast<int>(flags.size()),
         value, 0, 0, nullptr, nullptr, {}, {}};
  ptrs_.insert(ptrs_.end(), flags.begin(), flags.end());
  peers_.resize(ptrs_.size(), -1);
  steps_.push_back(s);
}

void CudaTransport::store(int lane, const std::vector<uint64_t*>& words, uint64_t value) {
  signal(lane, words, value);
  steps_.back().kind = kStepStore;
}

void CudaTransport::copy(int lane, void* dst, const void* src, size_t bytes) {
  steps_.push_back(Step{kStepCopy, lane, 0, 0, bytes, 0, 0, dst, src, {}, {}});
}

void CudaTransport::accumulate(int lane, float* dst, const void* src, size_t numel,
                                  DType dtype) {
  ReduceSpec spec;
  spec.dtype = dtype;
  steps_.push_back(Step{kStepAccumulate, lane, 0, 0, numel, 0, 0, dst, src, spec, {}});
}

void CudaTransport::fill_zero(int lane, void* dst, size_t bytes) {
  steps_.push_back(Step{kStepZero, lane, 0, 0, bytes, 0, 0, dst, nullptr, {}, {}});
}

void CudaTransport::reduce(int lane, void* dst, const std::vector<const void*>& srcs,
                              size_t numel, const ReduceSpec& spec) {
  Step s{kStepReduce, lane, static_cast<int>(ptrs_.size()), static_cast<int>(srcs.size()),
         numel, 0, 0, dst, nullptr, spec, {}};
  ptrs_.insert(ptrs_.end(), srcs.begin(), srcs.end());
  peers_.resize(ptrs_.size(), -1);
  steps_.push_back(s);
}

uint64_t CudaTransport::locate(const void* p, size_t bytes) {
  return segments_ ? segments_->locate(p, bytes) : 0;
}

void CudaTransport::copy_located(int lane, void* dst, const Located& src, size_t bytes) {
  // The site of the wait before it (the owner's "ready") names the operation in an error.
  const WaitSite site = steps_.empty() ? WaitSite{} : steps_.back().site;
  Step s{kStepCopyLocated, lane, 0, src.owner, bytes, reinterpret_cast<uint64_t>(src.where),
         src.offset, dst, src.staged, {}, site};
  steps_.push_back(s);
}

void CudaTransport::reduce_located(int lane, void* dst, const std::vector<Located>& srcs,
                                   size_t numel, const ReduceSpec& spec) {
  // The staged (or own) sources, then their words (null: the source itself); one offset.
  const WaitSite site = steps_.empty() ? WaitSite{} : steps_.back().site;
  Step s{kStepReduceLocated, lane, static_cast<int>(ptrs_.size()), static_cast<int>(srcs.size()),
         numel, 0, 0, dst, nullptr, spec, site};
  for (const Located& l : srcs) {
    ptrs_.push_back(l.staged);
    if (l.where) s.desc_id = l.offset;
  }
  for (const Located& l : srcs) ptrs_.push_back(l.where);
  peers_.resize(ptrs_.size(), -1);
  steps_.push_back(s);
}

void CudaTransport::end_op() {
  DeviceGuard g(device_);
  if (steps_.empty()) return;
  // A ring's chunk counters assume its operations run in issue order: one issued on
  // another stream than the previous one on this ring first waits for that one.
  auto event = [](const std::shared_ptr<void>& e) { return static_cast<cudaEvent_t>(e.get()); };
  for (Ring r : {ring_, also_}) {
    if (r != kNumRings && ring_done_[r] && ring_stream_[r] != op_stream_) {
      check(cudaStreamWaitEvent(op_stream_, event(ring_done_[r]), 0), "ordering after the ring's last op");
    }
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
  if (also_ != kNumRings) {
    ring_done_[also_] = ring_done_[ring_];
    ring_stream_[also_] = op_stream_;
  }
  last_done_ = ring_done_[ring_];
  // What a segment freed from now on waits for before its end is told to the peers: the last
  // operation of each ring that may read this rank's inputs in place.
  if (segments_) segments_->issued({ring_done_[kAgRing], ring_done_[kRsRing]});
}

std::shared_ptr<void> CudaTransport::completion(void* stream, bool after_last_op) {
  if (after_last_op && last_done_ && ring_stream_[ring_] == stream) return last_done_;
  DeviceGuard g(device_);
  std::shared_ptr<void> done = events_->share(events_->take());
  check(cudaEventRecord(static_cast<cudaEvent_t>(done.get()), static_cast<cudaStream_t>(stream)),
        "recording a collective's end");
  return done;
}

}  // namespace odc
