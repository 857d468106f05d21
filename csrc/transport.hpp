// Layer 2, the transport interface: what a transport does for the protocol (wait on
// counters, signal them, copy, reduce, on lanes), the error type and the text of wait
// errors. Depends on the layout (layout.hpp) only; a transport's set-up through the group's
// store is in rendezvous.hpp.
#pragma once

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "layout.hpp"

namespace odc {

// A communication failure (timeout, dead peer). The group cannot be used after it.
struct CommError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// What a wait is about, for the error raised when it times out.
struct WaitSite {
  const char* op;        // "all_gather" / "reduce_scatter"
  const char* what;      // "data from" / "ring space at"
  uint64_t op_seq;       // the group's collective sequence number
};

// What a wait also checks once its counters are reached: descs[i] (in this rank's window,
// stored by peer i with the data that counter announces) must hold `expected`, this
// rank's own descriptor, and then `id`: the number of the chunk waited for (ring
// collectives) or a RegisteredId (registered ones). A mismatch fails the group with both
// sides named.
struct DescCheck {
  std::vector<const uint64_t*> descs;  // parallel to the wait's counters
  uint64_t expected = 0;
  uint64_t id = 0;
};

// What a transport keeps in issue order: each operation runs after the previous one of its
// ring. The collectives' two rings (their chunk counters assume it), and decoupled mode's
// arena rings: gets, put-accumulates, the minibatch's sync, and the early takes (on an
// arena's side stream; apart from the sync, so that no arena's sync waits for another
// arena's peers). kNone: no ring (begin_op's `also`).
enum class Ring : int { kAllGather = 0, kReduceScatter, kArenaGet, kArenaPut, kArenaSync,
                        kArenaEarly, kNone };
constexpr int kNumRings = static_cast<int>(Ring::kNone);
inline int ring_index(Ring r) { return static_cast<int>(r); }

class ZeroCopyReads;
class Arenas;

// A transport moves bytes and counters between windows. Work is issued on *lanes*: lane 0 is
// the operation's own ordering domain, lane i (1..world-1) carries the traffic with peer
// (rank + i) % world. A host transport executes immediately in issue order; a device
// transport enqueues each lane on a stream. This is the core every transport has; what only
// some have (reads of memory in place, decoupled mode's arenas) are capability interfaces
// below, offered by the transport when it is made and looked up once by the channel.
class Transport {
 public:
  virtual ~Transport() = default;
  // A window has two parts: its counters (the layout's offsets below ag_ring) and its rings
  // (its AG ring and RS landing rings: the bytes at offset >= layout.ag_ring lie at
  // window(rank, kRings) + (offset - layout.ag_ring)). The rings' place is valid within an
  // operation: a transport may give them back between operations and take them at the next.
  enum Part { kCounters, kRings };
  virtual char* window(int rank, Part part = kCounters) = 0;
  // Block lane until every counter (in this rank's window) is >= target; then, with a
  // check, compare the peers' descriptors with this rank's.
  virtual void wait(int lane, const std::vector<const uint64_t*>& flags,
                    const std::vector<int>& peers, uint64_t target, const WaitSite& site,
                    const DescCheck* check = nullptr) = 0;
  // After everything issued on the lane before it, store value into each counter.
  // Signals issued at one point of a lane (only signals and stores between them) may
  // become visible in any order among themselves.
  virtual void signal(int lane, const std::vector<uint64_t*>& flags, uint64_t value) = 0;
  // Store a payload word (a descriptor) that peers read only after acquiring a counter
  // signalled later on the lane: it is visible before that counter, and need not be after
  // the data issued before it.
  virtual void store(int lane, const std::vector<uint64_t*>& words, uint64_t value) {
    signal(lane, words, value);
  }
  virtual void copy(int lane, void* dst, const void* src, size_t bytes) = 0;
  // A write into a peer's memory that only a successful wait may let through: wait for
  // `flag` >= target (checked as `wait` does), then copy `bytes` from src to dst and signal
  // `done` with `target`. Where the wait fails (a descriptor mismatch, a peer announcing
  // another collective, the timeout), neither the copy nor the signal happens: a peer's
  // memory is never written on a failed handshake, and a peer that waits for `done` gets an
  // error of its own instead of an output with a hole. The host transports' waits throw on
  // failure, so this default is all they need.
  virtual void put_after(int lane, const uint64_t* flag, int peer, uint64_t target,
                         const WaitSite& site, const DescCheck* check, void* dst,
                         const void* src, size_t bytes, uint64_t* done) {
    wait(lane, {flag}, {peer}, target, site, check);
    if (bytes) copy(lane, dst, src, bytes);
    signal(lane, {done}, target);
  }
  // dst[i] = spec.scale * sum_j srcs[j][i]
  virtual void reduce(int lane, void* dst, const std::vector<const void*>& srcs,
                      size_t numel, const ReduceSpec& spec) = 0;
  // Bracket one operation on `ring`: a device transport forks its peer lanes from the
  // operation's stream and joins them back at the end, and orders the operation after the
  // previous one on the same ring when that ran on another stream. `also`: a second ring
  // the operation moves chunks on (a staged all-gather pushed through the reduce-scatter's
  // landing rings): it is ordered after that ring's last op too, and is its last op.
  virtual void begin_op(void* stream, Ring ring, Ring also = Ring::kNone) {}
  virtual void end_op() {}
  // A device transport: an event (a cudaEvent_t, shared) that completes with the work issued
  // so far on `stream`. after_last_op: the caller issued nothing on the stream since this
  // transport's last operation, whose own end event then serves (no new record). Null for
  // host transports, whose work is done when they return.
  virtual std::shared_ptr<void> completion(void* stream, bool after_last_op) { return nullptr; }
  // What ran the last operation (diagnostics: the group's stats): none for a host transport;
  // blocks, the most GPU thread blocks (so SMs) it held at once, an upper bound.
  struct EngineUse {
    enum Engine { kNone, kFused, kCopyEngine } engine = kNone;  // kFused: one kernel
    int blocks = 0;
  };
  virtual EngineUse last_engine() const { return {}; }
  // A failure recorded asynchronously (e.g. by a device-side wait), or "".
  virtual std::string async_error() { return {}; }

  // The peers' announcements the waits of the collective in progress watch (PeerWatch;
  // set by the protocol at a collective's first transfer, cleared at its end).
  void watch(const PeerWatch& w) { watch_ = w; }
  // The capabilities this transport offers (null: not offered), fixed when it is made.
  ZeroCopyReads* zero_copy_reads() const { return offered_.zero_copy; }
  Arenas* arenas() const { return offered_.arenas; }

 protected:
  PeerWatch watch_;
  struct Capabilities {
    ZeroCopyReads* zero_copy = nullptr;
    Arenas* arenas = nullptr;
  } offered_;
};

// Direct collectives (Protocol::all_gather_direct): inputs read where their owners say, in
// memory the caller allocated anywhere (ODC_ZERO_COPY, every peer mapped). A located source is
// decided on the device, after the wait for its owner's "ready": the owner's Location word at
// `where` (in this rank's window) names its allocator segment, mapped here (the source is then
// that mapping + the word's offset + `offset`), or says "staged" (the source is `staged`, in
// the owner's window). `where` null: `staged` is the source (this rank's own input).
struct Located {
  const uint64_t* where = nullptr;
  int owner = 0;
  const char* staged = nullptr;
  size_t offset = 0;
};
class ZeroCopyReads {
 public:
  virtual ~ZeroCopyReads() = default;
  // The owner's side: the Location word of `bytes` at `p` if every peer can read them there,
  // else 0 (stage them). A first sight of p's segment shares it: the peers map it at their
  // next operation, and a later call finds it readable.
  virtual uint64_t locate(const void* p, size_t bytes) = 0;
  // Recorded in the transport's current operation, on its lanes.
  virtual void copy_located(int lane, void* dst, const Located& src, size_t bytes) = 0;
  // The write the other way (a pushed direct all-gather): `bytes` of src into the buffer
  // dst's owner said lies where its word says (plus dst.offset); nothing where the word says
  // it is not mapped (that owner reads for itself). dst.staged is unused. `guess`: the word
  // the owner is expected to say (published_output); where the device finds it did, the
  // transport may write with a copy engine to the place the host found for it.
  virtual void push_located(int lane, const Located& dst, const void* src, size_t bytes,
                            uint64_t guess = 0) = 0;
  // A pushed all-gather's output word, published by its owner as it issues call `number`, and
  // a peer's as published under `number` (0: not known here).
  virtual void publish_output(uint64_t number, uint64_t word) = 0;
  virtual uint64_t published_output(int peer, uint64_t number) = 0;
  // Diagnostics (the group's stats): the pushes to a guessed place so far, and those whose
  // guess the device confirmed (the others were written by the SM copy behind them).
  virtual std::pair<uint64_t, uint64_t> guessed_pushes() { return {0, 0}; }
  // dst[i] = combine of srcs[j][i] in order (reduce's semantics); srcs[j]'s owner is j.
  virtual void reduce_located(int lane, void* dst, const std::vector<Located>& srcs,
                              size_t numel, const ReduceSpec& spec) = 0;
};

// Decoupled mode and registered memory: more regions per rank ("arenas", one per decoupled
// model or pool block), created collectively; their operations run in the transport's
// current operation, on its lanes.
class Arenas {
 public:
  virtual ~Arenas() = default;
  // Collective over the group; returns the arena's id.
  virtual int create_arena(size_t bytes) = 0;
  // Collective over the group, once no operation on arena `id` is in flight on any rank: its
  // memory is given back (e.g. while a trainer has offloaded the model) and the id is not valid
  // any more. False where the memory cannot be given back (NVSHMEM's heap): the arena is kept,
  // valid and unchanged. The last arena released may take the window's rings with it
  // (Transport::window, kRings): the group's next operation or arena takes them again.
  virtual bool release_arena(int id) = 0;
  virtual char* arena(int id, int rank) = 0;
  // dst[i] += src[i] (src in `dtype`, dst fp32), safe while other ranks add into dst.
  virtual void accumulate(int lane, float* dst, const void* src, size_t numel, DType dtype) = 0;
  virtual void fill_zero(int lane, void* dst, size_t bytes) = 0;
  // Whether accumulate() reaches every peer (NVSHMEM has no float atomics for routed peers).
  virtual bool accumulates_everywhere() const { return true; }
  // Whether every peer's arenas are mapped here (loads and copies reach them directly):
  // registered memory (pool.hpp) needs it.
  virtual bool maps_every_peer() const { return true; }
};

std::string describe_wait(const WaitSite& site, int peer, uint64_t target, uint64_t seen,
                          std::chrono::milliseconds timeout);
// "all_gather of 32 bytes per rank (float32)", from an op_desc() word.
std::string describe_desc(uint64_t desc);
// The error of a failed DescCheck: `rank` expected descriptor `mine` with id `chunk`,
// `peer` stored `theirs` with id `their_chunk` (chunk numbers, or RegisteredIds).
std::string describe_mismatch(const WaitSite& site, int rank, int peer, uint64_t mine,
                              uint64_t theirs, uint64_t chunk, uint64_t their_chunk);
// The error of a watched wait (PeerWatch): `peer` announced `theirs` under the number of
// this rank's announcement `mine`, or gave the collective up (is_stopped(theirs), layout.hpp).
std::string describe_announced(const WaitSite& site, int rank, int peer, uint64_t mine,
                               uint64_t theirs);

}  // namespace odc
