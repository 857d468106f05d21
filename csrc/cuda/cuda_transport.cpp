// Layer 2, a transport: the CUDA transport (cuda_transport.hpp): the making and release of its
// parts, and the bracket of an operation that hands its recording to an engine.
#include "cuda_transport.hpp"

#include <algorithm>

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

// Most blocks of one fused kernel: ODC_FUSED_BLOCKS, within this rank's share of the GPU's SMs
// for two collectives at once (FSDP's all-gather and reduce-scatter streams; a 1024-thread
// block fills an SM; the ranks' kernels wait on each other, so their blocks should be resident
// together).
int fused_blocks(const CudaTransportOptions& o) {
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, o.device), "counting SMs");
  return std::max(1, std::min(o.fused_blocks, sms / (2 * std::max(1, o.ranks_on_gpu))));
}

}  // namespace

CudaTransport::CudaTransport(const TransportArgs& args, const CudaTransportOptions& o,
                             std::unique_ptr<DeviceMemory> memory)
    : a_(args), device_(o.device), memory_(std::move(memory)) {
  if (a_.world > kMaxPeers) {
    throw std::runtime_error("odc: the CUDA transport supports groups of at most " +
                             std::to_string(kMaxPeers) + " ranks");
  }
  DeviceGuard g(device_);
  check(preload_kernels(), "loading the transport's kernels");
  fused_ = std::make_unique<FusedEngine>(a_.world, o.small_op_bytes, fused_blocks(o));
  bases_ = memory_->open(a_, "ipc", a_.layout.ag_ring, "communication window");
  take_rings();
  if (o.zero_copy) segments_ = std::make_unique<SegmentTable>(a_, device_);
  errors_ = std::make_unique<DeviceErrorRecord>(a_, bases_, *memory_);
  StreamMemops memops;
  if (o.stream_memops) memops = StreamMemops::load(device_, a_.rank, bases_, *memory_);
  copy_engines_ = std::make_unique<CopyEngines>(
      a_.world, CopyEngines::Options{o.reduce_blocks, o.accumulate_blocks, o.peers_on_other_gpus},
      memops);
  // No peer may signal into a window before its owner has zeroed it and every
  // peer has opened it.
  store_barrier(a_, "ipc_open");
  // Last: its thread starts at once.
  if (memops) {
    watchdog_ = std::make_unique<Watchdog>(a_, device_, *errors_, bases_[a_.rank],
                                           order_.event_pool());
  }
  offered_.arenas = this;
  if (segments_) offered_.zero_copy = this;
}

CudaTransport::~CudaTransport() {
  int prev = 0;
  const bool switched = cudaGetDevice(&prev) == cudaSuccess && cudaSetDevice(device_) == cudaSuccess;
  (void)cudaDeviceSynchronize();  // the watchdog still releases a stuck wait meanwhile
  watchdog_.reset();
  order_.clear();
  copy_engines_.reset();
  fused_.reset();
  memory_->close(a_, bases_);
  if (!rings_.empty()) memory_->close(a_, rings_);
  for (auto& a : arenas_) memory_->close(a_, a);  // (a released one is empty)
  errors_.reset();
  segments_.reset();  // its mappings and table belong to this device
  if (switched) (void)cudaSetDevice(prev);
}

void CudaTransport::take_rings() {
  const std::string n = std::to_string(rings_made_++);
  rings_ = memory_->open(a_, "ipc_rings" + n, a_.layout.rings_bytes(), "communication rings");
  // No peer may copy into a rank's rings before their owner has zeroed them and every peer
  // has opened them (the first time, the window's own barrier follows).
  if (n != "0") store_barrier(a_, "ipc_rings_open" + n);
}

int CudaTransport::create_arena(size_t bytes) {
  DeviceGuard g(device_);
  if (rings_.empty()) take_rings();
  const int id = static_cast<int>(arenas_.size());
  arenas_.push_back(memory_->open(a_, "ipc_arena" + std::to_string(id), bytes, "arena"));
  // No peer may signal into an arena before its owner has zeroed it.
  store_barrier(a_, "ipc_arena_open" + std::to_string(id));
  return id;
}

bool CudaTransport::release_arena(int id) {
  if (!memory_->gives_back()) return false;
  DeviceGuard g(device_);
  // Every rank's device work that may touch the arena (its own, and its reads and adds into
  // the peers') is done before any rank unmaps or frees it.
  check(cudaDeviceSynchronize(), "finishing the work on an arena");
  store_barrier(a_, "ipc_arena_release" + std::to_string(id));
  memory_->close(a_, arenas_.at(id));
  arenas_[id].clear();
  const bool none_left = std::all_of(arenas_.begin(), arenas_.end(), [](const auto& a) { return a.empty(); });
  if (none_left && !rings_.empty()) {  // every rank decides alike
    memory_->close(a_, rings_);
    rings_.clear();
  }
  return true;
}

uint64_t CudaTransport::locate(const void* p, size_t bytes) {
  return segments_ ? segments_->locate(p, bytes) : 0;
}

void CudaTransport::push_located(int lane, const Located& dst, const void* src, size_t bytes,
                                 uint64_t guess) {
  // The guess's place here: valid while the owner's call is in flight (SegmentTable).
  char* at = guess && segments_ ? segments_->mapping_of(dst.owner, guess, dst.offset, bytes) : nullptr;
  recording_.push_located(lane, dst, src, bytes, at ? guess : 0, at);
}

void CudaTransport::publish_output(uint64_t number, uint64_t word) {
  if (segments_) segments_->publish_output(number, word);
}

uint64_t CudaTransport::published_output(int peer, uint64_t number) {
  return segments_ ? segments_->published_output(peer, number) : 0;
}

std::pair<uint64_t, uint64_t> CudaTransport::guessed_pushes() {
  if (!copy_engines_) return {0, 0};
  DeviceGuard g(device_);
  const GuessedPuts::Tally t = copy_engines_->guessed_tally();
  return {t.examined, t.confirmed};
}

void CudaTransport::put_after(int lane, const uint64_t* flag, int peer, uint64_t target,
                              const WaitSite& site, const DescCheck* check, void* dst,
                              const void* src, size_t bytes, uint64_t* done) {
  const size_t first = recording_.size();
  recording_.wait(lane, {flag}, {peer}, target, site, check);
  if (bytes) recording_.copy(lane, dst, src, bytes);
  recording_.signal(lane, {done}, target);
  // The fused kernel skips a lane's later steps where its wait fails; the copy engines run
  // these as a conditional graph (put_graphs.hpp).
  recording_.guard_from(first);
}

void CudaTransport::begin_op(void* stream, Ring ring, Ring also) {
  if (rings_.empty()) {  // given back with the last arena: every rank's next operation
    DeviceGuard g(device_);
    take_rings();
  }
  op_ = CurrentOp{static_cast<cudaStream_t>(stream), ring, also, EngineUse{}};
  order_.forget_last();
  recording_.clear();
  if (segments_) {  // the peers' segments shared since the last operation (host work only)
    DeviceGuard g(device_);
    segments_->refresh();
  }
}

void CudaTransport::end_op() {
  DeviceGuard g(device_);
  if (recording_.empty()) return;
  order_.before(op_.stream, op_.ring, op_.also);
  const OpEnv env{a_,     *memory_, errors_->on_device(), segments_ ? segments_->views() : nullptr,
                  watch_, op_.stream, op_.ring,           device_};
  op_.use = fused_->plan(recording_, memory_->any_routed())
                ? fused_->run(recording_, env)
                : copy_engines_->run(recording_, env, order_.events(), watchdog_.get());
  order_.after(op_.stream, op_.ring, op_.also);
  // What a segment freed from now on waits for before its end is told to the peers: the last
  // operation of each ring that may read this rank's inputs in place.
  if (segments_) segments_->issued({order_.last_of(Ring::kAllGather), order_.last_of(Ring::kReduceScatter)});
}

std::shared_ptr<void> CudaTransport::completion(void* stream, bool after_last_op) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (std::shared_ptr<void> last = order_.last_on(s, after_last_op)) return last;
  DeviceGuard g(device_);  // (only to record a new event)
  return order_.record(s);
}

}  // namespace odc
