// Layer 2, a transport: host shared memory (transport_shm.hpp).
#include "transport_shm.hpp"

#include "reduce_math.hpp"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>
#include <cstdio>
#include <cstdlib>
#include <thread>

namespace odc {
namespace {

std::string errno_text(const char* what) {
  return std::string("odc: ") + what + ": " + std::strerror(errno);
}

std::string unique_segment_name(int rank) {
  std::random_device rd;
  char buf[96];
  std::snprintf(buf, sizeof(buf), "/odc-%d-%d-%08x%08x", static_cast<int>(getpid()), rank,
                static_cast<unsigned>(rd()), static_cast<unsigned>(rd()));
  return buf;
}

// out[i] = combine over sources, in rank order, a block at a time in the accumulation type.
template <typename T, Combine C>
void reduce_typed(void* dst, const std::vector<const void*>& srcs, size_t numel, double scale) {
  using A = typename AccOf<T>::type;
  T* out = static_cast<T*>(dst);
  const size_t n = srcs.size();
  constexpr size_t kBlock = 256;
  A acc[kBlock];
  const bool scaled = C == Combine::Sum && scale != 1.0;
  for (size_t base = 0; base < numel; base += kBlock) {
    const size_t len = std::min(kBlock, numel - base);
    const T* s0 = static_cast<const T*>(srcs[0]) + base;
    for (size_t i = 0; i < len; ++i) acc[i] = static_cast<A>(s0[i]);
    for (size_t j = 1; j < n; ++j) {
      const T* s = static_cast<const T*>(srcs[j]) + base;
      for (size_t i = 0; i < len; ++i) acc[i] = combine<C>(acc[i], static_cast<A>(s[i]));
    }
    if (scaled) {
      for (size_t i = 0; i < len; ++i) acc[i] = static_cast<A>(acc[i] * static_cast<A>(scale));
    }
    for (size_t i = 0; i < len; ++i) out[base + i] = static_cast<T>(acc[i]);
  }
}

template <typename T>
void reduce_as(void* dst, const std::vector<const void*>& srcs, size_t numel, const ReduceSpec& spec,
               double scale) {
  switch (spec.combine) {
    case Combine::Sum: reduce_typed<T, Combine::Sum>(dst, srcs, numel, scale); break;
    case Combine::Max: reduce_typed<T, Combine::Max>(dst, srcs, numel, scale); break;
    case Combine::Min: reduce_typed<T, Combine::Min>(dst, srcs, numel, scale); break;
    case Combine::Product: reduce_typed<T, Combine::Product>(dst, srcs, numel, scale); break;
  }
}

double host_scale(const ReduceSpec& spec) {
  return spec.scale_ptr ? *spec.scale_ptr : spec.scale;
}

}  // namespace

ShmTransport::ShmTransport(const TransportArgs& args) : a_(args) {
  maps_ = map_segments("shm", a_.layout.total);
  offered_.arenas = this;
}

std::vector<char*> map_host_segments(const TransportArgs& a, const std::string& tag, size_t bytes,
                                     std::vector<pid_t>* pids) {
  std::vector<char*> maps(a.world, nullptr);
  const std::string name = unique_segment_name(a.rank);
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error(errno_text("shm_open of the window failed"));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    close(fd);
    shm_unlink(name.c_str());
    throw std::runtime_error(errno_text("could not size the shared-memory window") + " (" +
                             std::to_string(bytes >> 20) + " MiB; lower ODC_CHUNK_BYTES or "
                             "ODC_RING_SLOTS, or enlarge /dev/shm)");
  }
  // Touch the pages now, so a too-small /dev/shm fails here and not with SIGBUS later.
  if (posix_fallocate(fd, 0, static_cast<off_t>(bytes)) != 0) {
    close(fd);
    shm_unlink(name.c_str());
    throw std::runtime_error("odc: /dev/shm has no room for a " + std::to_string(bytes >> 20) +
                             " MiB window; lower ODC_CHUNK_BYTES or ODC_RING_SLOTS, or enlarge "
                             "/dev/shm");
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    throw std::runtime_error(errno_text("mmap of the window failed"));
  }
  maps[a.rank] = static_cast<char*>(p);

  const std::string mine = std::to_string(getpid()) + " " + name;
  auto all = exchange_blobs(a, tag, std::vector<uint8_t>(mine.begin(), mine.end()));
  if (pids) pids->resize(a.world);
  for (int r = 0; r < a.world; ++r) {
    const std::string blob(all[r].begin(), all[r].end());  // "<pid> <segment name>"
    const size_t space = blob.find(' ');
    if (pids) (*pids)[r] = static_cast<pid_t>(std::strtol(blob.c_str(), nullptr, 10));
    const std::string peer_name = space == std::string::npos ? "" : blob.substr(space + 1);
    if (r == a.rank) continue;
    int pfd = shm_open(peer_name.c_str(), O_RDWR, 0600);
    if (pfd < 0) {
      throw std::runtime_error(errno_text("could not open the window of rank ") +
                               std::to_string(r) + " (are all ranks of the group on one host?)");
    }
    void* q = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, pfd, 0);
    close(pfd);
    if (q == MAP_FAILED) throw std::runtime_error(errno_text("mmap of a peer window failed"));
    maps[r] = static_cast<char*>(q);
  }
  // Once everyone has mapped it, the name can go: the memory lives while mapped,
  // and nothing is left behind in /dev/shm if a process dies.
  store_barrier(a, tag + "_mapped");
  shm_unlink(name.c_str());
  return maps;
}

std::vector<char*> ShmTransport::map_segments(const std::string& tag, size_t bytes) {
  return map_host_segments(a_, tag, bytes, &pids_);
}

int ShmTransport::create_arena(size_t bytes) {
  const int id = static_cast<int>(arenas_.size());
  arenas_.push_back(map_segments("shm_arena" + std::to_string(id), bytes));
  arena_bytes_.push_back(bytes);
  return id;
}

bool ShmTransport::release_arena(int id) {
  store_barrier(a_, "shm_arena_release" + std::to_string(id));  // every rank is done with it
  for (char*& m : arenas_.at(id)) {
    if (m) munmap(m, arena_bytes_[id]);
    m = nullptr;
  }
  arenas_[id].clear();
  return true;
}

void ShmTransport::accumulate(int, float* dst, const void* src, size_t numel, DType dtype) {
  // Other ranks add into the same accumulator: compare-and-swap on the float's bits.
  auto add = [dst](size_t i, float v) {
    uint32_t* word = reinterpret_cast<uint32_t*>(dst + i);
    uint32_t seen = __atomic_load_n(word, __ATOMIC_RELAXED);
    for (;;) {
      float f;
      std::memcpy(&f, &seen, sizeof(f));
      f += v;
      uint32_t next;
      std::memcpy(&next, &f, sizeof(next));
      if (__atomic_compare_exchange_n(word, &seen, next, true, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {
        return;
      }
    }
  };
  switch (dtype) {
    case DType::F32: {
      const float* s = static_cast<const float*>(src);
      for (size_t i = 0; i < numel; ++i) add(i, s[i]);
      break;
    }
    case DType::BF16: {
      const c10::BFloat16* s = static_cast<const c10::BFloat16*>(src);
      for (size_t i = 0; i < numel; ++i) add(i, static_cast<float>(s[i]));
      break;
    }
    case DType::F16: {
      const c10::Half* s = static_cast<const c10::Half*>(src);
      for (size_t i = 0; i < numel; ++i) add(i, static_cast<float>(s[i]));
      break;
    }
    default:
      throw std::invalid_argument(std::string("odc: decoupled accumulate of ") + dtype_name(dtype));
  }
}

void ShmTransport::fill_zero(int, void* dst, size_t bytes) { std::memset(dst, 0, bytes); }

ShmTransport::~ShmTransport() {
  for (char* m : maps_) {
    if (m) munmap(m, a_.layout.total);
  }
  for (size_t id = 0; id < arenas_.size(); ++id) {
    for (char* m : arenas_[id]) {
      if (m) munmap(m, arena_bytes_[id]);
    }
  }
}

void ShmTransport::give_up(int code, const std::string& message) {
  if (watch_.slots) {
    const uint64_t number = watch_.word & kAnnounceSeqMask;
    for (int p = 0; p < a_.world; ++p) {
      if (p == a_.rank || !maps_[p]) continue;
      auto* slot = reinterpret_cast<uint64_t*>(maps_[p] + a_.layout.announce_slot(a_.rank, number));
      __atomic_store_n(slot, stopped_word(watch_.word, code), __ATOMIC_RELEASE);
    }
  }
  throw CommError(message);
}

void ShmTransport::wait(int, const std::vector<const uint64_t*>& flags,
                        const std::vector<int>& peers, uint64_t target, const WaitSite& site,
                        const DescCheck* check) {
  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < flags.size(); ++i) {
    uint64_t spins = 0;
    for (;;) {
      const uint64_t seen = __atomic_load_n(flags[i], __ATOMIC_ACQUIRE);
      if (seen >= target) break;
      ++spins;
      if (spins < 64) continue;
      // Ranks often outnumber cores (CI): give the core away quickly.
      if (spins < 1024) {
        sched_yield();
        continue;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      if (watch_.slots) {  // the peer announced another collective at this point: fail now
        const uint64_t theirs = __atomic_load_n(watch_.slot_of(peers[i]), __ATOMIC_ACQUIRE);
        // (a counter that arrived meanwhile comes first: its descriptor says more)
        if (watch_.differs(theirs) && __atomic_load_n(flags[i], __ATOMIC_ACQUIRE) < target) {
          give_up(gave_up_same(watch_.word, theirs) ? kStopPeerStopped : kStopAnnounced,
                  describe_announced(site, a_.rank, peers[i], watch_.word, theirs));
        }
      }
      if (spins % 256 == 0) {
        if (kill(pids_[peers[i]], 0) != 0 && errno == ESRCH) {
          give_up(kStopExited, "odc: " + std::string(site.op) + " #" + std::to_string(site.op_seq) +
                                   ": rank " + std::to_string(peers[i]) + " (pid " +
                                   std::to_string(pids_[peers[i]]) +
                                   ") has exited. The group cannot be used any more.");
        }
        const auto waited = std::chrono::steady_clock::now() - start;
        if (waited > a_.timeout()) give_up(kStopTimeout, describe_wait(site, peers[i], target, seen, a_.timeout()));
      }
    }
    // The counter's acquire load orders this read after the peer's descriptor store.
    if (check) {
      const uint64_t theirs = __atomic_load_n(check->descs[i], __ATOMIC_RELAXED);
      const uint64_t chunk = __atomic_load_n(check->descs[i] + 1, __ATOMIC_RELAXED);
      if (theirs != check->expected || chunk != check->id) {
        give_up(kStopMismatch, describe_mismatch(site, a_.rank, peers[i], check->expected, theirs,
                                                 check->id, chunk));
      }
    }
  }
}

void ShmTransport::signal(int, const std::vector<uint64_t*>& flags, uint64_t value) {
  for (uint64_t* f : flags) __atomic_store_n(f, value, __ATOMIC_RELEASE);
}

void ShmTransport::copy(int, void* dst, const void* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
}

void ShmTransport::reduce(int, void* dst, const std::vector<const void*>& srcs, size_t numel,
                          const ReduceSpec& spec) {
  // fp32 scale for the fp32-accumulated types, as the GPU kernels apply it
  const double scale = spec.dtype == DType::F64 ? host_scale(spec)
                                                : static_cast<float>(host_scale(spec));
  switch (spec.dtype) {
    case DType::F32: reduce_as<float>(dst, srcs, numel, spec, scale); break;
    case DType::BF16: reduce_as<c10::BFloat16>(dst, srcs, numel, spec, scale); break;
    case DType::F16: reduce_as<c10::Half>(dst, srcs, numel, spec, scale); break;
    case DType::F64: reduce_as<double>(dst, srcs, numel, spec, scale); break;
    case DType::I32: reduce_as<int32_t>(dst, srcs, numel, spec, scale); break;
    case DType::I64: reduce_as<int64_t>(dst, srcs, numel, spec, scale); break;
    case DType::U8: reduce_as<uint8_t>(dst, srcs, numel, spec, scale); break;
    case DType::I8: reduce_as<int8_t>(dst, srcs, numel, spec, scale); break;
  }
}

}  // namespace odc
