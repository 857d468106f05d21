// Layer 2, a transport: the CUDA transport's watchdog (cuda_transport.hpp): a host thread, never
// in the data path, that watches the waits the copy engines left to stream memory operations
// (which cannot time out by themselves) and turns one that outlives the group's timeout, or
// whose peer announced another collective, into the group's error, naming the peer and what
// was awaited; then it releases the waits so that the queued work drains.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "error_record.hpp"
#include "event_pool.hpp"

namespace odc {

// A stream wait of an operation: on `flag` for `target`, announced by `peer`.
struct WatchedWait {
  const uint64_t* flag;
  uint64_t target;
  int peer;
  WaitSite site;
};

class Watchdog {
 public:
  // window: this rank's window (its counters come first, layout.hpp); the thread starts here.
  Watchdog(const TransportArgs& a, int device, DeviceErrorRecord& errors, char* window,
           std::shared_ptr<EventPool> events);
  ~Watchdog();  // stops the thread (the caller finished the device's work first)
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // The stream waits of one operation, between its events `start` and `end` (from the pool:
  // given back once it has ended), and the announcements they watch.
  void track(cudaEvent_t start, cudaEvent_t end, std::vector<WatchedWait> waits,
             const PeerWatch& watch);

 private:
  struct Tracked {
    cudaEvent_t start, end;
    std::vector<WatchedWait> waits;
    bool started = false;
    std::chrono::steady_clock::time_point started_at;
    PeerWatch watch;
  };
  // How long a started operation waits before the watchdog reads the announcements.
  static constexpr std::chrono::milliseconds kWatchAfter{100};
  void loop();
  bool announced_other(const Tracked& op);
  bool diagnose_and_release(const Tracked& op);  // mu_ held
  void tell_peers_given_up(const PeerWatch& watch, int code);
  bool read(const uint64_t* word, uint64_t* value);  // a word of device memory, now

  const TransportArgs& a_;
  int device_;
  DeviceErrorRecord& errors_;
  char* window_;
  std::shared_ptr<EventPool> events_;
  cudaStream_t stream_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Tracked> tracked_;
  bool stop_ = false;
  std::thread thread_;  // last: started once the rest is made
};

}  // namespace odc
