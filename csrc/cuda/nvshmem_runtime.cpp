// Layer 2, a transport's memory: NVSHMEM (nvshmem_runtime.hpp).
#include "nvshmem_runtime.hpp"

#include <c10/util/Exception.h>
#include <cuda_runtime.h>
#include <nvshmem_host.h>
#include <host/nvshmemx_coll_api.h>

#include <cstdlib>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>

#include "../text.hpp"

namespace odc::nvshmem {
namespace {

std::mutex init_mu;  // guards the slab too: groups' transports start on several threads

// odc's slab: world-collective symmetric allocations ("segments", added by init and grow)
// that groups sub-allocate their windows and arenas from, first fit, each segment with its
// own bump pointer (windows are never returned until process exit). Offsets are virtual:
// segment i covers [start, start + bytes) of one address space; a window never straddles
// two. Append-only with a published count, so the routed path reads it without the lock.
struct Segment {
  char* base;
  size_t bytes;
  size_t start;
  size_t used;  // bump pointer within the segment (guarded by init_mu)
};
constexpr int kMaxSegments = 16;
Segment segments[kMaxSegments];
std::atomic<int> n_segments{0};
size_t slab_size = 0;  // the segments' total
std::atomic<uint64_t> routed_copies{0};  // observability: routed get / put calls issued
std::atomic<uint64_t> routed_signals{0};
std::atomic<uint64_t> staged_copies{0};
std::atomic<uint64_t> staged_bytes{0};
std::atomic<int> network_peers{0};  // summed over the groups' windows

// One staging room: a routed copy with its local side outside the slab moves through it in
// pieces of this size (get + local copy, or local copy + put, in stream order).
constexpr size_t kStageBytes = size_t{2} << 20;

void check_cuda(cudaError_t e, const char* what) {
  ODC_CHECK(e == cudaSuccess, Error, "odc nvshmem: ", what, " failed: ", cudaGetErrorString(e));
}

void set_default_env(const char* name, const std::string& value) {
  if (std::getenv(name) == nullptr) setenv(name, value.c_str(), 0);
}

// A symmetric allocation (collective: every PE, same order, same size) freed on scope exit.
struct Symmetric {
  explicit Symmetric(size_t bytes) : p(nvshmem_align(256, bytes)) {
    ODC_CHECK(p != nullptr, Error, "odc nvshmem: the symmetric heap cannot hold ", bytes,
              " more bytes (raise NVSHMEM_SYMMETRIC_SIZE before the first initialisation)");
  }
  ~Symmetric() { nvshmem_free(p); }
  Symmetric(const Symmetric&) = delete;
  Symmetric& operator=(const Symmetric&) = delete;
  void* p;
};

// Collective over every PE (same order, same size); caller holds init_mu.
void add_segment(size_t bytes) {
  const int n = n_segments.load(std::memory_order_relaxed);
  ODC_CHECK(n < kMaxSegments, Error, "odc nvshmem: the slab already has ", kMaxSegments,
            " segments; initialise with a larger slab_bytes");
  auto* p = static_cast<char*>(nvshmem_align(4096, bytes));
  ODC_CHECK(p != nullptr, Error, "odc nvshmem: the symmetric heap cannot hold ", bytes,
            " more bytes for odc's slab (it has ", slab_size, "); set NVSHMEM_SYMMETRIC_SIZE "
            "before the first initialisation, or size the slab with "
            "torch_odc_backend.nvshmem.init(model=...) before odc's first CUDA collective");
  segments[n] = Segment{p, bytes, slab_size, 0};
  n_segments.store(n + 1, std::memory_order_release);
  slab_size += bytes;
}

size_t round4k(size_t n) { return (n + 4095) / 4096 * 4096; }

// Whether [p, p + bytes) lies in one slab segment (NVSHMEM can use it remotely).
bool in_slab(const void* p, size_t bytes) {
  const auto* c = static_cast<const char*>(p);
  const int n = n_segments.load(std::memory_order_acquire);
  for (int i = 0; i < n; ++i) {
    if (c >= segments[i].base && c + bytes <= segments[i].base + segments[i].bytes) return true;
  }
  return false;
}

// The local address of virtual offset `off`.
char* slab_at(size_t off) {
  const int n = n_segments.load(std::memory_order_acquire);
  for (int i = 0; i < n; ++i) {
    if (off < segments[i].start + segments[i].bytes) return segments[i].base + (off - segments[i].start);
  }
  ODC_CHECK(false, Error, "odc nvshmem: offset ", off, " is past the ", slab_size, "-byte slab");
  return nullptr;
}

}  // namespace

std::vector<uint8_t> unique_id() {
  nvshmemx_uniqueid_t id;
  std::memset(&id, 0, sizeof(id));
  ODC_CHECK(nvshmemx_get_uniqueid(&id) == 0, Error, "odc nvshmem: nvshmemx_get_uniqueid failed");
  const auto* b = reinterpret_cast<const uint8_t*>(&id);
  return std::vector<uint8_t>(b, b + sizeof(id));
}

bool init(const std::vector<uint8_t>& id, int global_rank, int world, int device, size_t slab_bytes) {
  std::lock_guard<std::mutex> lock(init_mu);
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
  bool fresh = false;
  if (nvshmemx_init_status() < NVSHMEM_STATUS_IS_INITIALIZED) {
    ODC_CHECK(id.size() == sizeof(nvshmemx_uniqueid_t), ValueError, "odc nvshmem: a unique id has ",
              sizeof(nvshmemx_uniqueid_t), " bytes, got ", id.size());
    ODC_CHECK(world > 0 && global_rank >= 0 && global_rank < world, ValueError,
              "odc nvshmem: rank ", global_rank, " is not in a world of ", world);
    // NVSHMEM reads its options once, here; keep the user's settings
    if (slab_bytes > 0) set_default_env("NVSHMEM_SYMMETRIC_SIZE", std::to_string(slab_bytes + (512ull << 20)));
    set_default_env("NVSHMEM_DISABLE_NVLS", "1");
    nvshmemx_uniqueid_t uid;
    std::memcpy(&uid, id.data(), sizeof(uid));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    ODC_CHECK(nvshmemx_set_attr_uniqueid_args(global_rank, world, &uid, &attr) == 0, Error,
              "odc nvshmem: nvshmemx_set_attr_uniqueid_args failed");
    // When it finds no transport to some PE, NVSHMEM 3.4.5 ends the process itself (exit
    // status 255, "Unable to initialize any transports"; README, Limitations); an exit handler
    // of ours cannot speak then (NVSHMEM's own handlers exit again first).
    const int rc = nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
    ODC_CHECK(rc == 0, Error, "odc nvshmem: initialisation failed (rank ", global_rank, " of ",
              world, "); NVSHMEM_DEBUG=INFO prints NVSHMEM's reasons (peers on other hosts need "
              "a working NVSHMEM_REMOTE_TRANSPORT)");
    fresh = true;
  }
  // Ours or PyTorch's: the transport addresses peers as PE = global rank.
  ODC_CHECK(nvshmem_my_pe() == global_rank && nvshmem_n_pes() == world, Error,
            "odc nvshmem: NVSHMEM in this process has PE ", nvshmem_my_pe(), " of ", nvshmem_n_pes(),
            ", expected ", global_rank, " of ", world,
            " (it was initialised over another set of ranks)");
  // every rank passes here with the same state: the allocation is collective
  if (n_segments.load() == 0 && slab_bytes > 0) add_segment(slab_bytes);
  return fresh;
}

void grow(size_t bytes) {
  std::lock_guard<std::mutex> lock(init_mu);
  ODC_CHECK(nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED, Error,
            "odc nvshmem: not initialised (call torch_odc_backend.nvshmem.init() first)");
  ODC_CHECK(bytes > 0, ValueError, "odc nvshmem: grow the slab by > 0 bytes");
  add_segment(bytes);
}

namespace {

std::vector<uint8_t> as_bytes(uint64_t v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  return std::vector<uint8_t>(p, p + sizeof(v));
}

uint64_t from_bytes(const std::vector<uint8_t>& b) {
  uint64_t v = 0;
  std::memcpy(&v, b.data(), std::min(b.size(), sizeof(v)));
  return v;
}

// Placeholder addresses of routed peers: kRoutedBase + group rank * kRoutedStride + offset
// in the slab. Far above any user or device address, never dereferenced.
constexpr uintptr_t kRoutedBase = uintptr_t{1} << 60;
constexpr uintptr_t kRoutedStride = uintptr_t{1} << 40;  // slabs are far below 1 TiB

class SymmetricMemory final : public DeviceMemory {
 public:
  SymmetricMemory(std::vector<int> pes, std::vector<bool> routed, bool stage_always)
      : pes_(std::move(pes)), routed_(std::move(routed)), stage_always_(stage_always),
        network_(routed_.size(), false) {
    for (bool r : routed_) any_routed_ = any_routed_ || r;
  }

  bool any_routed() const override { return any_routed_; }
  bool routed(const void* p) const override {
    return any_routed_ && reinterpret_cast<uintptr_t>(p) >= kRoutedBase;
  }

  // dst or src is a routed peer's placeholder; the other side is this GPU's memory. To a
  // peer NVSHMEM maps, NVSHMEM copies peer-to-peer from any local address; to a network peer
  // the local side must be remotely usable: the slab directly, anything else through this
  // copy's staging room (one extra copy on this GPU, far faster than the network).
  void copy_routed(int slot, void* dst, const void* src, size_t bytes, cudaStream_t s) override {
    const bool get = routed(src);
    const auto [r, pe, sym] = decode(get ? src : dst);
    const void* local = get ? static_cast<const void*>(dst) : src;
    if (stage_ != nullptr && (stage_always_ || network_.at(r)) && !in_slab(local, bytes)) {
      ODC_CHECK(slot >= 0 && static_cast<size_t>(slot + 1) * kStageBytes <= stage_size_, Error,
                "odc nvshmem: staging room ", slot, " is past the group's ", stage_size_, " bytes");
      char* room = stage_ + static_cast<size_t>(slot) * kStageBytes;
      auto* remote = static_cast<char*>(sym);
      for (size_t off = 0; off < bytes; off += kStageBytes) {
        const size_t n = std::min(kStageBytes, bytes - off);
        if (get) {
          nvshmemx_getmem_on_stream(room, remote + off, n, pe, s);
          check_cuda(cudaMemcpyAsync(static_cast<char*>(dst) + off, room, n,
                                     cudaMemcpyDeviceToDevice, s), "staging a get");
        } else {
          check_cuda(cudaMemcpyAsync(room, static_cast<const char*>(src) + off, n,
                                     cudaMemcpyDeviceToDevice, s), "staging a put");
          nvshmemx_putmem_on_stream(remote + off, room, n, pe, s);  // room reusable after it
        }
        routed_copies.fetch_add(1, std::memory_order_relaxed);
      }
      staged_copies.fetch_add(1, std::memory_order_relaxed);
      staged_bytes.fetch_add(bytes, std::memory_order_relaxed);
      return;
    }
    if (get) {
      nvshmemx_getmem_on_stream(dst, sym, bytes, pe, s);  // complete in stream order
    } else {
      nvshmemx_putmem_on_stream(sym, src, bytes, pe, s);
    }
    routed_copies.fetch_add(1, std::memory_order_relaxed);
  }

  void quiet_routed(cudaStream_t s) override {
    nvshmemx_quiet_on_stream(s);  // the puts issued before it have landed at their targets
  }

  void signal_routed(uint64_t* flag, uint64_t value, cudaStream_t s) override {
    const auto [r, pe, sym] = decode(flag);
    nvshmemx_signal_op_on_stream(static_cast<uint64_t*>(sym), value, NVSHMEM_SIGNAL_SET, pe, s);
    routed_signals.fetch_add(1, std::memory_order_relaxed);
  }

  std::vector<char*> open(const TransportArgs& a, const std::string& tag, size_t bytes,
                          const char* what) override {
    // Members agree on one place: per segment the largest of their bump pointers, then the
    // first segment where `bytes` fit after it, so a window sits at the same symmetric
    // address on every member. Another group may reserve on this rank between the exchange
    // and the reservation (transports start on several threads): then every member learns
    // it and the round repeats past the new bump pointers. The group's first block (its
    // communication window) carries the staging rooms after it when some peer is routed
    // (every member of a group that spans hosts has one, so the members agree on the size).
    const size_t asked = bytes;
    const size_t rooms = (!opened_ && any_routed_) ? stage_bytes(a.world) : 0;
    if (rooms > 0) bytes = round4k(bytes) + rooms;
    const uint64_t off = reserve(a, tag, bytes, what);
    std::vector<char*> bases(a.world, nullptr);
    char* local = slab_at(off);
    check_cuda(cudaMemset(local, 0, asked), "zeroing a window");
    check_cuda(cudaDeviceSynchronize(), "zeroing a window");
    if (rooms > 0) {
      stage_ = local + round4k(asked);
      stage_size_ = rooms;
    }
    for (int r = 0; r < a.world; ++r) {
      if (r == a.rank) {
        bases[r] = local;
      } else if (routed_.at(r)) {
        // A peer NVSHMEM cannot map is a network peer: its copies stage their local side.
        const bool network = nvshmem_ptr(local, pes_.at(r)) == nullptr;
        if (!opened_) {
          network_[r] = network;
          if (network) network_peers.fetch_add(1, std::memory_order_relaxed);
        }
        bases[r] = reinterpret_cast<char*>(kRoutedBase + r * kRoutedStride + off);
      } else {
        bases[r] = static_cast<char*>(nvshmem_ptr(local, pes_.at(r)));
        ODC_CHECK(bases[r] != nullptr, Error, "odc nvshmem: rank ", r, " (PE ", pes_.at(r),
                  ") is on this host but not reachable peer-to-peer");
      }
    }
    opened_ = true;
    return bases;  // the transport barriers before any peer may signal into it
  }

  void close(const TransportArgs&, std::vector<char*>& bases) override {
    bases.assign(bases.size(), nullptr);  // the slab keeps it (a bump allocator)
  }
  bool gives_back() const override { return false; }

 private:
  // The offset in the slab where `bytes` lie on every member (open's agreement).
  uint64_t reserve(const TransportArgs& a, const std::string& tag, size_t bytes, const char* what) {
    for (int round = 0;; ++round) {
      const std::string key = tag + "_nvshmem_" + std::to_string(round);
      std::vector<uint64_t> mine;
      {
        std::lock_guard<std::mutex> lock(init_mu);
        for (int i = 0; i < n_segments.load(); ++i) mine.push_back(segments[i].used);
      }
      std::vector<uint64_t> top(mine.size(), 0);
      const auto* raw = reinterpret_cast<const uint8_t*>(mine.data());
      for (const auto& b : exchange_blobs(a, key + "_offsets",
                                          std::vector<uint8_t>(raw, raw + mine.size() * 8))) {
        ODC_CHECK(b.size() == mine.size() * 8, Error, "odc nvshmem: members of this group see ",
                  b.size() / 8, " and ", mine.size(), " slab segments (grow the slab on every "
                  "rank: torch_odc_backend.nvshmem.init is collective)");
        for (size_t i = 0; i < top.size(); ++i) {
          uint64_t v;
          std::memcpy(&v, b.data() + 8 * i, 8);
          top[i] = std::max(top[i], v);
        }
      }
      int seg = -1;
      for (size_t i = 0; i < top.size() && seg < 0; ++i) {
        if (top[i] + bytes <= segments[i].bytes) seg = static_cast<int>(i);
      }
      ODC_CHECK(seg >= 0, Error, "odc nvshmem: the ", what, " needs ", bytes, " bytes and no "
                "segment of the ", slab_size, "-byte slab has them free; call "
                "torch_odc_backend.nvshmem.init(model=...) (or with a larger slab_bytes) on every "
                "rank after fully_shard and before odc's first CUDA collective");
      uint64_t ok;
      {
        std::lock_guard<std::mutex> lock(init_mu);
        Segment& g = segments[seg];
        ok = top[seg] >= g.used;
        if (ok) g.used = round4k(top[seg] + bytes);
      }
      const uint64_t off = segments[seg].start + top[seg];
      bool all_ok = true;
      for (const auto& b : exchange_blobs(a, key + "_reserved", as_bytes(ok))) {
        all_ok &= from_bytes(b) != 0;
      }
      if (all_ok) return off;  // else: what this rank reserved stays a hole
    }
  }

  struct Routed {
    int rank;  // group rank
    int pe;
    void* sym;  // the symmetric object's address on this PE
  };
  Routed decode(const void* p) const {
    const uintptr_t v = reinterpret_cast<uintptr_t>(p) - kRoutedBase;
    const auto r = static_cast<int>(v / kRoutedStride);
    return {r, pes_.at(r), slab_at(v % kRoutedStride)};
  }

  std::vector<int> pes_;
  std::vector<bool> routed_;
  bool stage_always_;
  std::vector<bool> network_;  // routed peers NVSHMEM cannot map (set by the first window)
  bool any_routed_ = false;
  bool opened_ = false;
  char* stage_ = nullptr;  // staging rooms, after the group's window in this rank's slab
  size_t stage_size_ = 0;
};

}  // namespace

size_t stage_bytes(int world) {
  return static_cast<size_t>(kNumRings) * static_cast<size_t>(world) * kStageBytes;
}

std::unique_ptr<DeviceMemory> make_memory(std::vector<int> pe_of_rank, std::vector<bool> routed,
                                          int device, bool stage_always) {
  std::lock_guard<std::mutex> lock(init_mu);
  ODC_CHECK(nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED && n_segments.load() > 0, Error,
            "odc: peers over NVSHMEM (ODC_TRANSPORT=nvshmem, or ODC_HOST_SIZE hosts): call "
            "torch_odc_backend.nvshmem.init() on every rank before the first CUDA collective");
  cudaPointerAttributes attr{};
  check_cuda(cudaPointerGetAttributes(&attr, segments[0].base), "cudaPointerGetAttributes");
  ODC_CHECK(attr.device == device, Error, "odc nvshmem: the slab is on cuda:", attr.device,
            " but this group's transport runs on cuda:", device,
            " (call torch.cuda.set_device before torch_odc_backend.nvshmem.init())");
  for (int pe : pe_of_rank) {
    ODC_CHECK(pe >= 0 && pe < nvshmem_n_pes(), Error, "odc nvshmem: PE ", pe, " is not in the world of ",
              nvshmem_n_pes());
  }
  ODC_CHECK(routed.size() == pe_of_rank.size(), ValueError, "odc nvshmem: ", routed.size(),
            " routing flags for ", pe_of_rank.size(), " ranks");
  return std::make_unique<SymmetricMemory>(std::move(pe_of_rank), std::move(routed), stage_always);
}

Status status() {
  Status s;
  s.init_status = nvshmemx_init_status();
  if (s.init_status >= NVSHMEM_STATUS_IS_INITIALIZED) {
    s.my_pe = nvshmem_my_pe();
    s.n_pes = nvshmem_n_pes();
  }
  std::lock_guard<std::mutex> lock(init_mu);
  s.slab_bytes = slab_size;
  for (int i = 0; i < n_segments.load(); ++i) {
    s.slab_used += segments[i].used;
    s.segments.emplace_back(segments[i].bytes, segments[i].used);
  }
  s.routed_copies = routed_copies.load();
  s.routed_signals = routed_signals.load();
  s.staged_copies = staged_copies.load();
  s.staged_bytes = staged_bytes.load();
  s.network_peers = network_peers.load();
  return s;
}

SelfTest ring_selftest(size_t bytes, void* stream_ptr) {
  ODC_CHECK(nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED, Error,
            "odc nvshmem: not initialised (call torch_odc_backend.nvshmem.init() first)");
  ODC_CHECK(bytes > 0, ValueError, "odc nvshmem: self-test needs bytes > 0");
  // NVSHMEM aborts the process on its barriers when PEs share a GPU without MPS
  ODC_CHECK(nvshmemx_init_status() != NVSHMEM_STATUS_LIMITED_MPG, Error,
            "odc nvshmem: the self-test needs NVSHMEM's barrier, which NVSHMEM does not offer "
            "while several PEs share a GPU without MPS (limited MPG mode); odc's own transport "
            "does not use it");
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int me = nvshmem_my_pe(), n = nvshmem_n_pes();
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  Symmetric src(bytes), dst(bytes), sig(sizeof(uint64_t));
  check_cuda(cudaMemsetAsync(src.p, me + 1, bytes, stream), "cudaMemsetAsync");
  check_cuda(cudaMemsetAsync(dst.p, 0, bytes, stream), "cudaMemsetAsync");
  check_cuda(cudaMemsetAsync(sig.p, 0, sizeof(uint64_t), stream), "cudaMemsetAsync");
  nvshmemx_barrier_all_on_stream(stream);  // every PE's buffers are zeroed before any put

  SelfTest r;
  r.next_pe_is_p2p = nvshmem_ptr(dst.p, next) != nullptr;
  cudaEvent_t t0, t1;
  check_cuda(cudaEventCreate(&t0), "cudaEventCreate");
  check_cuda(cudaEventCreate(&t1), "cudaEventCreate");
  check_cuda(cudaEventRecord(t0, stream), "cudaEventRecord");
  nvshmemx_putmem_signal_on_stream(dst.p, src.p, bytes, static_cast<uint64_t*>(sig.p), 1,
                                   NVSHMEM_SIGNAL_SET, next, stream);
  nvshmemx_signal_wait_until_on_stream(static_cast<uint64_t*>(sig.p), NVSHMEM_CMP_GE, 1, stream);
  check_cuda(cudaEventRecord(t1, stream), "cudaEventRecord");

  std::vector<uint8_t> got(bytes);
  check_cuda(cudaMemcpyAsync(got.data(), dst.p, bytes, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  float ms = 0;
  check_cuda(cudaEventElapsedTime(&ms, t0, t1), "cudaEventElapsedTime");
  r.put_signal_wait_us = 1e3 * ms;
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  const auto expect = static_cast<uint8_t>(prev + 1);
  for (uint8_t b : got) r.mismatched_bytes += b != expect;
  nvshmemx_barrier_all_on_stream(stream);  // no PE frees while a peer still puts into it
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return r;
}

}  // namespace odc::nvshmem
