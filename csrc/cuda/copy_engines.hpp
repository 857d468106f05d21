// Layer 2, a transport: the CUDA transport's copy engines: a recorded operation (steps.hpp)
// whose data is large runs with each lane on a stream of its own, forked from the operation's
// stream and joined back (lane_streams.hpp). Data moves by cudaMemcpyAsync (no SMs); counters
// are waited on and signalled with stream memory operations (stream_memops.hpp: no SM is held
// while a lane waits; the watchdog times them out), or by one-warp flag kernels where the
// device lacks them; the owner's reduction is a kernel with a bounded number of blocks; puts
// run as CUDA graphs (put_graphs.hpp), as do pushes to a guessed place (guessed_puts.hpp).
#pragma once

#include <vector>

#include "event_pool.hpp"
#include "guessed_puts.hpp"
#include "lane_streams.hpp"
#include "op_env.hpp"
#include "put_graphs.hpp"
#include "stream_memops.hpp"
#include "watchdog.hpp"

namespace odc {

class CopyEngines {
 public:
  struct Options {
    int reduce_blocks;           // the most blocks of a reduction or located copy
    int accumulate_blocks;       // each peer's put-accumulate kernel (decoupled mode)
    bool peers_on_other_gpus;    // some peer's memory is across NVLink
  };
  CopyEngines(int world, const Options& o, StreamMemops memops);
  ~CopyEngines();
  CopyEngines(const CopyEngines&) = delete;
  CopyEngines& operator=(const CopyEngines&) = delete;

  // Runs `r` on env.stream (its lanes merged where its data moves on one). The watchdog, where
  // the waits are stream memory operations, watches them from `events`' start to end.
  Transport::EngineUse run(StepRecording& r, const OpEnv& env, EventPool& events,
                           Watchdog* watchdog);
  GuessedPuts::Tally guessed_tally() { return guessed_.tally(); }

 private:
  // One operation being issued: its steps, environment and what it has used.
  struct Issue {
    const StepRecording& r;
    const OpEnv& env;
    std::vector<bool> flagged;         // lanes that ran a flag kernel
    std::vector<int> lane_blocks;      // per lane: its largest kernel's grid
    std::vector<WatchedWait> waits;    // its stream waits, for the watchdog
    std::vector<uint64_t*> words;      // scratch: a signal step's counters
    std::vector<const LocatedPushStep*> guessed;  // its pushes to guessed places (launch_guessed)
    const uint64_t* guess_hits = nullptr;          // their hit words, once launched
    uint64_t guess_serial = 0;
  };
  void issue_step(Issue& op, const Step& s);
  void launch_flags(Issue& op, int lane, const WaitStep* wait);
  void prepare(Issue& op, int lane);  // before a data step: pending signals, the lane forked
  void issue_copy(Issue& op, int lane, const CopyStep& c);
  void issue_reduce(Issue& op, int lane, const ReduceStep& s, const LocatedReduceStep* located);
  void issue_push(Issue& op, int lane, const LocatedPushStep& s);
  void launch_guessed(Issue& op);
  void issue_located_copy(Issue& op, int lane, void* local, const Located& far, bool push,
                          size_t bytes, const WaitSite& site, const uint64_t* hit = nullptr,
                          uint64_t serial = 0);
  // Signals (signals.cpp): batched per lane into the lane's next flag kernel, or written at once
  // as stream memory operations.
  void flush_signals(Issue& op, int lane);
  void flush_all_signals(Issue& op);
  void issue_signal(Issue& op, int lane, const std::vector<uint64_t*>& flags, uint64_t value,
                    bool payload);
  void issue_direct_signal(Issue& op, int lane, const std::vector<uint64_t*>& flags,
                           uint64_t value, bool payload);

  int world_;
  int reduce_blocks_;      // the most blocks of a reduction or located copy
  int accumulate_blocks_;  // blocks of each peer's put-accumulate kernel (decoupled mode)
  bool peers_on_other_gpus_;
  StreamMemops memops_;
  LaneStreams lanes_;
  PutGraphs puts_;
  GuessedPuts guessed_;
  uint64_t guess_serial_ = 0;             // one per operation with guessed pushes (their hit words)
  cudaEvent_t guessed_done_ = nullptr;    // after an operation's guessed pushes' graph
  // Signals issued on a lane are folded into that lane's next wait kernel (unless a wait on
  // another lane comes first: then they go out on their own kernel before it): up to
  // kSignalBatches batches of words, each with its value; the payload batches are stored
  // first, then one fence, then the counters (FlagOp).
  struct PendingSignals {
    std::vector<uint64_t*> flags[kSignalBatches];
    uint64_t value[kSignalBatches] = {};
    bool payload[kSignalBatches] = {};
    int batches = 0;
  };
  std::vector<PendingSignals> pending_;
};

}  // namespace odc
