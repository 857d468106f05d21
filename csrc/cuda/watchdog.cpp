// Layer 2, a transport: the CUDA transport's watchdog (watchdog.hpp).
#include "watchdog.hpp"

#include <atomic>

namespace odc {

Watchdog::Watchdog(const TransportArgs& a, int device, DeviceErrorRecord& errors, char* window,
                   std::shared_ptr<EventPool> events)
    : a_(a), device_(device), errors_(errors), window_(window), events_(std::move(events)) {
  check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "creating a stream");
  thread_ = std::thread([this] { loop(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  for (auto& t : tracked_) {
    (void)cudaEventDestroy(t.start);
    (void)cudaEventDestroy(t.end);
  }
  (void)cudaStreamDestroy(stream_);
}

void Watchdog::track(cudaEvent_t start, cudaEvent_t end, std::vector<WatchedWait> waits,
                     const PeerWatch& watch) {
  Tracked t;
  t.start = start;
  t.end = end;
  t.waits = std::move(waits);
  t.watch = watch;
  std::lock_guard<std::mutex> lk(mu_);
  tracked_.push_back(std::move(t));
}

// Polls the tracked operations. An operation counts as started once the GPU has reached it (its
// start event completed); if it is still unfinished a group timeout later, its first unmet wait
// names the peer, the error is recorded for the next call to raise, and every counter of this
// rank's window is set past any target so that the queued work drains instead of hanging.
void Watchdog::loop() {
  (void)cudaSetDevice(device_);
  std::unique_lock<std::mutex> lk(mu_);
  bool released = false;
  while (!stop_) {
    cv_.wait_for(lk, std::chrono::milliseconds(20));
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

bool Watchdog::read(const uint64_t* word, uint64_t* value) {
  return cudaMemcpyAsync(value, word, sizeof(*value), cudaMemcpyDeviceToHost, stream_) ==
             cudaSuccess &&
         cudaStreamSynchronize(stream_) == cudaSuccess;
}

// Stream memory operations cannot watch the peers' announcements themselves (PeerWatch):
// the watchdog reads the slots of the peers an unfinished operation waits for, and
// records a peer that announced another collective at this point.
bool Watchdog::announced_other(const Tracked& op) {
  for (const WatchedWait& w : op.waits) {
    uint64_t theirs = 0;
    if (!read(op.watch.slot_of(w.peer), &theirs)) return false;
    if (!op.watch.differs(theirs)) continue;
    volatile DeviceError* e = errors_.on_host();
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
void Watchdog::tell_peers_given_up(const PeerWatch& watch, int code) {
  if (!watch.slots) return;
  const uint64_t stopped = stopped_word(watch.word, code);  // read before the synchronisation
  const uint64_t slot = (watch.word & kAnnounceSeqMask) % kAnnounceSlots;
  volatile DeviceError* e = errors_.on_host();
  for (int i = 0; i < e->n_notify; ++i) {
    (void)cudaMemcpyAsync(e->notify[i] + slot, &stopped, sizeof(stopped), cudaMemcpyHostToDevice,
                          stream_);
  }
  (void)cudaStreamSynchronize(stream_);
}

bool Watchdog::diagnose_and_release(const Tracked& op) {
  // Each awaited counter is read on its own: it may live in the window or in an arena.
  const uint64_t released = uint64_t{1} << 62;
  volatile DeviceError* e = errors_.on_host();
  bool unmet = e->code != 0;  // already failed: keep releasing
  std::vector<const uint64_t*> stuck;
  for (const WatchedWait& w : op.waits) {
    uint64_t seen = 0;
    if (!read(w.flag, &seen)) return false;
    if (seen >= w.target) continue;
    unmet = true;
    stuck.push_back(w.flag);
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
  (void)cudaMemcpyAsync(window_, counters.data(), flag_bytes, cudaMemcpyHostToDevice, stream_);
  for (const uint64_t* f : stuck) {
    (void)cudaMemcpyAsync(const_cast<uint64_t*>(f), &released, sizeof(released),
                          cudaMemcpyHostToDevice, stream_);
  }
  (void)cudaStreamSynchronize(stream_);
  return true;
}

}  // namespace odc
