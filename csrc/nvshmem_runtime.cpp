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

#include "text.hpp"

namespace odc::nvshmem {
namespace {

std::mutex init_mu;  // guards the slab too: groups' transports start on several threads
char* slab = nullptr;  // symmetric, world-collective; groups sub-allocate windows from it
size_t slab_size = 0;
size_t slab_used = 0;  // a bump pointer: windows are never returned (until process exit)
std::atomic<uint64_t> routed_copies{0};  // observability: routed get / put calls issued
std::atomic<uint64_t> routed_signals{0};

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
    ODC_CHECK(nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) == 0, Error,
              "odc nvshmem: initialisation failed (rank ", global_rank, " of ", world, ")");
    fresh = true;
  }
  // Ours or PyTorch's: the transport addresses peers as PE = global rank.
  ODC_CHECK(nvshmem_my_pe() == global_rank && nvshmem_n_pes() == world, Error,
            "odc nvshmem: NVSHMEM in this process has PE ", nvshmem_my_pe(), " of ", nvshmem_n_pes(),
            ", expected ", global_rank, " of ", world,
            " (it was initialised over another set of ranks)");
  if (slab == nullptr && slab_bytes > 0) {  // every rank passes here: the allocation is collective
    slab = static_cast<char*>(nvshmem_align(4096, slab_bytes));
    ODC_CHECK(slab != nullptr, Error, "odc nvshmem: the symmetric heap cannot hold a ", slab_bytes,
              "-byte slab (NVSHMEM_SYMMETRIC_SIZE is set too low, or torch's symmetric memory uses it)");
    slab_size = slab_bytes;
  }
  return fresh;
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
  SymmetricMemory(std::vector<int> pes, std::vector<bool> routed)
      : pes_(std::move(pes)), routed_(std::move(routed)) {
    for (bool r : routed_) any_routed_ = any_routed_ || r;
  }

  bool any_routed() const override { return any_routed_; }
  bool routed(const void* p) const override {
    return any_routed_ && reinterpret_cast<uintptr_t>(p) >= kRoutedBase;
  }

  // dst or src is a routed peer's placeholder; the other side is this GPU's memory (on
  // one host NVSHMEM copies peer-to-peer; to another host the local side must be in the
  // symmetric heap or registered: not handled yet).
  void copy_routed(void* dst, const void* src, size_t bytes, cudaStream_t s) override {
    if (routed(src)) {
      const auto [pe, sym] = decode(src);
      nvshmemx_getmem_on_stream(dst, sym, bytes, pe, s);  // complete in stream order
    } else {
      const auto [pe, sym] = decode(dst);
      nvshmemx_putmem_on_stream(sym, src, bytes, pe, s);
    }
    routed_copies.fetch_add(1, std::memory_order_relaxed);
  }

  void quiet_routed(cudaStream_t s) override {
    nvshmemx_quiet_on_stream(s);  // the puts issued before it have landed at their targets
  }

  void signal_routed(uint64_t* flag, uint64_t value, cudaStream_t s) override {
    const auto [pe, sym] = decode(flag);
    nvshmemx_signal_op_on_stream(static_cast<uint64_t*>(sym), value, NVSHMEM_SIGNAL_SET, pe, s);
    routed_signals.fetch_add(1, std::memory_order_relaxed);
  }

  std::vector<char*> open(const TransportArgs& a, const std::string& tag, size_t bytes,
                          const char* what) override {
    // Members agree on one offset (the largest of their bump pointers), so a window sits at
    // the same symmetric address on every member. Another group may reserve on this rank
    // between the exchange and the reservation (transports start on several threads): then
    // every member learns it and the round repeats past the new bump pointer.
    uint64_t off = 0;
    for (int round = 0;; ++round) {
      const std::string key = tag + "_nvshmem_" + std::to_string(round);
      uint64_t mine;
      {
        std::lock_guard<std::mutex> lock(init_mu);
        mine = slab_used;
      }
      off = 0;
      for (const auto& b : exchange_blobs(a, key + "_offset", as_bytes(mine))) {
        off = std::max(off, from_bytes(b));
      }
      ODC_CHECK(off + bytes <= slab_size, Error, "odc nvshmem: the ", what, " needs ", bytes,
                " bytes at offset ", off, " of the ", slab_size, "-byte slab; pass a larger "
                "slab_bytes to torch_odc_backend.nvshmem.init()");
      uint64_t ok;
      {
        std::lock_guard<std::mutex> lock(init_mu);
        ok = off >= slab_used;
        if (ok) slab_used = std::max<uint64_t>(slab_used, (off + bytes + 4095) / 4096 * 4096);
      }
      bool all_ok = true;
      for (const auto& b : exchange_blobs(a, key + "_reserved", as_bytes(ok))) {
        all_ok &= from_bytes(b) != 0;
      }
      if (all_ok) break;  // else: what this rank reserved stays a hole
    }
    std::vector<char*> bases(a.world, nullptr);
    char* local = slab + off;
    check_cuda(cudaMemset(local, 0, bytes), "zeroing a window");
    check_cuda(cudaDeviceSynchronize(), "zeroing a window");
    for (int r = 0; r < a.world; ++r) {
      if (r == a.rank) {
        bases[r] = local;
      } else if (routed_.at(r)) {
        // A peer NVSHMEM reaches only over the network would need the user's buffers (the
        // other side of each get / put) registered with NVSHMEM: not implemented yet.
        ODC_CHECK(nvshmem_ptr(local, pes_.at(r)) != nullptr, Error, "odc nvshmem: rank ", r,
                  " (PE ", pes_.at(r), ") is reachable only over the network; odc cannot use "
                  "such peers yet (registration of the user's buffers is not implemented)");
        bases[r] = reinterpret_cast<char*>(kRoutedBase + r * kRoutedStride + off);
      } else {
        bases[r] = static_cast<char*>(nvshmem_ptr(local, pes_.at(r)));
        ODC_CHECK(bases[r] != nullptr, Error, "odc nvshmem: rank ", r, " (PE ", pes_.at(r),
                  ") is on this host but not reachable peer-to-peer");
      }
    }
    return bases;  // the transport barriers before any peer may signal into it
  }

  void close(const TransportArgs&, std::vector<char*>& bases) override {
    bases.assign(bases.size(), nullptr);  // the slab keeps it (a bump allocator)
  }

 private:
  std::pair<int, void*> decode(const void* p) const {
    const uintptr_t v = reinterpret_cast<uintptr_t>(p) - kRoutedBase;
    const auto r = static_cast<size_t>(v / kRoutedStride);
    return {pes_.at(r), slab + v % kRoutedStride};
  }

  std::vector<int> pes_;
  std::vector<bool> routed_;
  bool any_routed_ = false;
};

}  // namespace

std::unique_ptr<DeviceMemory> make_memory(std::vector<int> pe_of_rank, std::vector<bool> routed,
                                          int device) {
  std::lock_guard<std::mutex> lock(init_mu);
  ODC_CHECK(nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED && slab != nullptr, Error,
            "odc: peers over NVSHMEM (ODC_TRANSPORT=nvshmem, or ODC_HOST_SIZE hosts): call "
            "torch_odc_backend.nvshmem.init() on every rank before the first CUDA collective");
  cudaPointerAttributes attr{};
  check_cuda(cudaPointerGetAttributes(&attr, slab), "cudaPointerGetAttributes");
  ODC_CHECK(attr.device == device, Error, "odc nvshmem: the slab is on cuda:", attr.device,
            " but this group's transport runs on cuda:", device,
            " (call torch.cuda.set_device before torch_odc_backend.nvshmem.init())");
  for (int pe : pe_of_rank) {
    ODC_CHECK(pe >= 0 && pe < nvshmem_n_pes(), Error, "odc nvshmem: PE ", pe, " is not in the world of ",
              nvshmem_n_pes());
  }
  ODC_CHECK(routed.size() == pe_of_rank.size(), ValueError, "odc nvshmem: ", routed.size(),
            " routing flags for ", pe_of_rank.size(), " ranks");
  return std::make_unique<SymmetricMemory>(std::move(pe_of_rank), std::move(routed));
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
  s.slab_used = slab_used;
  s.routed_copies = routed_copies.load();
  s.routed_signals = routed_signals.load();
  return s;
}

SelfTest ring_selftest(size_t bytes, void* stream_ptr) {
  ODC_CHECK(nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED, Error,
            "odc nvshmem: not initialised (call torch_odc_backend.nvshmem.init() first)");
  ODC_CHECK(bytes > 0, ValueError, "odc nvshmem: self-test needs bytes > 0");
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
