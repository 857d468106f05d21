// Layer 2, a transport: the CUDA transport's watchdog (cuda_transport.hpp): a host thread that
// watches the device-side waits of issued operations and turns one that outlives the group's
// timeout into the group's asynchronous error, naming the peer and what it was waiting for.
#include "cuda_transport.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace odc {

void CudaTransport::watchdog_loop() {
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
bool CudaTransport::announced_other(const Tracked& op) {
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
      e->code = gave_up_same(op.watch.word, theirs) ? kStopPeerStopped : kStopAnnounced;
      tell_peers_given_up(op.watch, e->code);
    }
    return true;
  }
  return false;
}

// What record_error does on the device after a failure (layout.hpp, kAnnounceStopped), from
// the host: the waits the watchdog diagnoses are stream memory operations.
void CudaTransport::tell_peers_given_up(const PeerWatch& watch, int code) {
  if (!watch.slots) return;
  const uint64_t stopped = stopped_word(watch.word, code);  // read before the synchronisation
  const uint64_t slot = (watch.word & kAnnounceSeqMask) % kAnnounceSlots;
  for (int i = 0; i < err_host_->n_notify; ++i) {
    (void)cudaMemcpyAsync(err_host_->notify[i] + slot, &stopped, sizeof(stopped),
                          cudaMemcpyHostToDevice, wd_stream_);
  }
  (void)cudaStreamSynchronize(wd_stream_);
}

bool CudaTransport::diagnose_and_release(const Tracked& op) {
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
      e->code = kStopTimeout;
      tell_peers_given_up(op.watch, e->code);
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


std::string CudaTransport::async_error() {
  volatile DeviceError* e = err_host_;
  const int code = e->code;
  if (code == 0) return {};
  std::atomic_thread_fence(std::memory_order_acquire);  // the fields were written before code
  const char* op = e->op;
  const char* what = e->what;
  WaitSite site{op ? op : "collective", what ? what : "a counter of", e->op_seq};
  const std::string text =
      code == 4   ? "odc: " + std::string(site.op) + " (collective #" + std::to_string(site.op_seq) +
                      ") on rank " + std::to_string(a_.rank) + ": rank " + std::to_string(e->peer) +
                      " named memory this rank cannot read (its segment " + std::to_string(e->target) +
                      ", generation " + std::to_string(e->mine) + ", up to byte " + std::to_string(e->seen) +
                      "; this rank has generation " + std::to_string(e->theirs) + "); nothing was read"
      : code == kStopAnnounced || code == kStopPeerStopped
          ? describe_announced(site, a_.rank, e->peer, e->mine, e->theirs)
      : code == 2 ? describe_mismatch(site, a_.rank, e->peer, e->mine, e->theirs, e->target, e->seen)
                  : describe_wait(site, e->peer, e->target, e->seen, a_.timeout());
  return text + " (detected on the GPU; results of this and later collectives are invalid)";
}

}  // namespace odc
