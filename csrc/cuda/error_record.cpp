// Layer 2, a transport: the CUDA transport's error record (error_record.hpp).
#include "error_record.hpp"

#include <atomic>
#include <cstring>

namespace odc {

DeviceErrorRecord::DeviceErrorRecord(const TransportArgs& a, const std::vector<char*>& bases,
                                     const DeviceMemory& memory) {
  check(cudaHostAlloc(reinterpret_cast<void**>(&host_), sizeof(DeviceError), cudaHostAllocMapped),
        "allocating the error record");
  std::memset(host_, 0, sizeof(DeviceError));
  check(cudaMalloc(reinterpret_cast<void**>(&claim_), sizeof(int)), "allocating the error record");
  check(cudaMemset(claim_, 0, sizeof(int)), "zeroing the error record");
  host_->claim = claim_;
  for (int p = 0; p < a.world; ++p) {  // where a failure is told to the peers
    if (p != a.rank && !memory.routed(bases[p])) {
      host_->notify[host_->n_notify++] =
          reinterpret_cast<uint64_t*>(bases[p] + a.layout.announce_slot(a.rank, 0));
    }
  }
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_), host_, 0),
        "mapping the error record");
}

DeviceErrorRecord::~DeviceErrorRecord() {
  if (host_) (void)cudaFreeHost(host_);
  if (claim_) (void)cudaFree(claim_);
}

std::string DeviceErrorRecord::text(int rank, std::chrono::milliseconds timeout) const {
  volatile DeviceError* e = host_;
  const int code = e->code;
  if (code == 0) return {};
  std::atomic_thread_fence(std::memory_order_acquire);  // the fields were written before code
  const char* op = e->op;
  const char* what = e->what;
  WaitSite site{op ? op : "collective", what ? what : "a counter of", e->op_seq};
  const std::string text =
      code == 4   ? "odc: " + std::string(site.op) + " (collective #" + std::to_string(site.op_seq) +
                      ") on rank " + std::to_string(rank) + ": rank " + std::to_string(e->peer) +
                      " named memory this rank cannot read (its segment " + std::to_string(e->target) +
                      ", generation " + std::to_string(e->mine) + ", up to byte " + std::to_string(e->seen) +
                      "; this rank has generation " + std::to_string(e->theirs) + "); nothing was read"
      : code == kStopAnnounced || code == kStopPeerStopped
          ? describe_announced(site, rank, e->peer, e->mine, e->theirs)
      : code == 2 ? describe_mismatch(site, rank, e->peer, e->mine, e->theirs, e->target, e->seen)
                  : describe_wait(site, e->peer, e->target, e->seen, timeout);
  return text + " (detected on the GPU; results of this and later collectives are invalid)";
}

}  // namespace odc
