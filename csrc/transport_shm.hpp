// Layer 2, a transport: host shared memory (CPU tensors). Depends on the transport
// interface and its set-up (rendezvous.hpp, which includes transport.hpp).
//
// Host shared-memory transport: CPU tensors of ranks on one host. Each window
// is a POSIX shared-memory segment mapped by every rank of the group; gets,
// puts and reductions are done by the calling thread, in issue order.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "rendezvous.hpp"

namespace odc {

// Create this rank's POSIX shared-memory segment of `bytes` (zeroed) and map every rank's
// (collective: `tag` names the rendezvous in the store); pids: every rank's process id.
std::vector<char*> map_host_segments(const TransportArgs& a, const std::string& tag, size_t bytes,
                                     std::vector<pid_t>* pids = nullptr);

class ShmTransport final : public Transport, public Arenas {
 public:
  explicit ShmTransport(const TransportArgs& args);
  ~ShmTransport() override;

  char* window(int rank, Part part = kCounters) override {  // the rings within the mapping
    return part == kRings ? maps_[rank] + a_.layout.ag_ring : maps_[rank];
  }
  void wait(int lane, const std::vector<const uint64_t*>& flags, const std::vector<int>& peers,
            uint64_t target, const WaitSite& site, const DescCheck* check) override;
  void signal(int lane, const std::vector<uint64_t*>& flags, uint64_t value) override;
  void copy(int lane, void* dst, const void* src, size_t bytes) override;
  void reduce(int lane, void* dst, const std::vector<const void*>& srcs, size_t numel,
              const ReduceSpec& spec) override;
  int create_arena(size_t bytes) override;
  bool release_arena(int id) override;
  char* arena(int id, int rank) override { return arenas_.at(id).at(rank); }  // released: throws
  void accumulate(int lane, float* dst, const void* src, size_t numel, DType dtype) override;
  void fill_zero(int lane, void* dst, size_t bytes) override;

 private:
  // Tells the peers this rank gave the collective in progress up (layout.hpp,
  // kAnnounceStopped: their waits on it fail at once), then throws CommError(message).
  [[noreturn]] void give_up(int code, const std::string& message);
  // Create this rank's segment of `bytes`, map every rank's (collective; `tag` names
  // the rendezvous in the store); fills pids_ on the first call.
  std::vector<char*> map_segments(const std::string& tag, size_t bytes);

  TransportArgs a_;
  std::vector<char*> maps_;
  std::vector<std::vector<char*>> arenas_;
  std::vector<size_t> arena_bytes_;
  std::vector<pid_t> pids_;
};

}  // namespace odc
