// The one-sided protocol shared by every transport.
//
// Each rank owns a *window*: memory its peers can read and write directly (host
// shared memory, or CUDA IPC). A window holds monotonically increasing 64-bit
// counters ("flags") and two data rings:
//   * the AG ring: the owner publishes its shard chunk by chunk; readers *get*
//     chunks straight from it (the owner takes no part in a get);
//   * the RS landing rings, one per source: a sender *puts* its contribution
//     chunk into the owner's ring, and the owner reduces the landed chunks.
// Every flag lives in the window of the rank that waits on it, so waits poll
// local memory and signals are single remote stores of a counter value (no
// remote atomics). Buffer reuse is protected by these counters: a producer
// waits only when its ring is full, never for a whole collective to finish.
// Next to each chunk a producer stores its operation's *descriptor* (what it is,
// dtype, bytes per rank, reduce op) and the chunk's sequence number in the waiting
// rank's window; the waiting rank compares them with its own, so ranks that disagree
// about a collective, or whose sequences of collectives drifted apart, fail with an
// error naming both sides instead of exchanging wrong data.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace odc {

enum class RedOp : int { Sum = 0, Avg = 1, PreMulSum = 2, Max = 3, Min = 4, Product = 5 };
// Element types a reduction handles (FSDP's reduce-scatters use the first three).
enum class DType : int { F32 = 0, BF16 = 1, F16 = 2, F64 = 3, I32 = 4, I64 = 5, U8 = 6, I8 = 7 };

const char* dtype_name(DType d);
size_t dtype_size(DType d);

// A collective's descriptor: one 64-bit word that every rank of the group computes for
// its own call and checks against its peers'. 0 means "not checked" (ODC_MATCH_CHECK=0).
//   bit 63: set (a descriptor, never a stale zero)   bits 60-62: kind
//   bits 56-59: reduce op (1 + RedOp; 0: none)       bits 48-55: element type (c10 ScalarType)
//   bits 40-47: root (broadcast, scatter, gather)    bits 0-39: bytes (per rank, or per pair)
enum class OpKind : int {
  AllGather = 1, ReduceScatter, AllReduce, Broadcast, AllToAll, Scatter, Gather
};
uint64_t op_desc(OpKind kind, int scalar_type, uint64_t bytes, int red_op, int root = 0);
struct OpDescFields {
  OpKind kind;
  int scalar_type;
  uint64_t bytes;
  int red_op;  // 0, or 1 + RedOp
  int root;
};
OpDescFields decode_op_desc(uint64_t desc);

// Every collective a rank starts is *announced* to each peer before its first transfer:
// one word in the peer's window, slot [announcer][number % kAnnounceSlots], holding the
// collective's kind (its descriptor's kind bits: dtype, sizes, reduce op and root are
// checked with the data, as before) and, in the low 40 bits, the
// collective's number on that channel (1, 2, ...; ranks issue the same collectives in the
// same order, so the numbers agree). A wait that spins on a peer also watches the slot of
// that peer for its own number: a peer that announced a *different* collective under the
// same number (one rank all-gathers while the other reduce-scatters) fails the wait at
// once, naming both, instead of after the group's timeout.
constexpr int kAnnounceSlots = 16;
constexpr uint64_t kAnnounceSeqMask = (uint64_t{1} << 40) - 1;
inline uint64_t announce_word(uint64_t desc, uint64_t number) {
  constexpr uint64_t kKindBits = uint64_t{15} << 60;  // bit 63 (a descriptor) and the kind
  return (desc & kKindBits) | (number & kAnnounceSeqMask);
}
// What a wait watches while it spins (no watch: slots == nullptr).
struct PeerWatch {
  const uint64_t* slots = nullptr;  // this rank's announce slots, [world][kAnnounceSlots]
  uint64_t word = 0;                // this rank's own announcement of the collective
  const uint64_t* slot_of(int peer) const {
    return slots + static_cast<size_t>(peer) * kAnnounceSlots + (word & kAnnounceSeqMask) % kAnnounceSlots;
  }
  // Whether `theirs` (read from slot_of(peer)) announces another collective under our number.
  bool differs(uint64_t theirs) const {
    return (theirs & kAnnounceSeqMask) == (word & kAnnounceSeqMask) && theirs != word;
  }
};

// How values combine, element by element across ranks, in rank order (deterministic):
// Sum (AVG and PREMUL_SUM are a Sum times `scale`), Max, Min or Product; accumulated in
// fp32 for the 16- and 32-bit floats, fp64 for float64, int64 for integers, and rounded
// once to the dtype.
enum class Combine : int { Sum = 0, Max, Min, Product };
struct ReduceSpec {
  DType dtype = DType::F32;
  Combine combine = Combine::Sum;
  double scale = 1.0;                  // Sum of floats: AVG: 1/world; PREMUL_SUM: factor
  const float* scale_ptr = nullptr;    // PREMUL_SUM with a tensor factor (converted to fp32)
};

// Byte layout of a window; identical on every rank of a group.
struct WindowLayout {
  static constexpr size_t kFlagStride = 128;  // one counter per 128-byte line
  enum Flag : int { AgReady = 0, AgAck, RsReady, RsFree, kNumFlagArrays };
  enum Desc : int { AgDesc = 0, RsDesc, kNumDescArrays };

  WindowLayout() = default;
  WindowLayout(int world, size_t chunk_bytes, int slots);

  int world = 0;
  size_t chunk_bytes = 0;
  int slots = 0;
  size_t flags_bytes = 0;  // the counters come first
  // Offset of the descriptors: per kind, peer and ring slot, 16 bytes: the descriptor and
  // the sequence number of the chunk it came with.
  static constexpr size_t kDescBytes = 16;
  size_t descs = 0;
  size_t announce = 0;  // offset of the announce slots: [world][kAnnounceSlots] words
  size_t ag_ring = 0;  // offset of the AG ring (slots * chunk_bytes)
  size_t rs_ring = 0;  // offset of the RS landing rings (world * slots * chunk_bytes)
  size_t total = 0;

  // Offset of counter `kind`[index]: index is the peer the counter is about.
  size_t flag(Flag kind, int index) const {
    return (static_cast<size_t>(kind) * world + index) * kFlagStride;
  }
  // Offset of the descriptor `peer` stored with chunk `chunk` of ring `kind` (in the
  // window of the rank that waits for that chunk).
  size_t desc(Desc kind, int peer, uint64_t chunk) const {
    return descs + ((static_cast<size_t>(kind) * world + peer) * slots + chunk % slots) * kDescBytes;
  }
  size_t announce_slot(int announcer, uint64_t number) const {
    return announce + (static_cast<size_t>(announcer) * kAnnounceSlots + number % kAnnounceSlots) * 8;
  }
  size_t ag_slot(uint64_t chunk) const { return ag_ring + (chunk % slots) * chunk_bytes; }
  size_t rs_slot(int src, uint64_t chunk) const {
    return rs_ring + (static_cast<size_t>(src) * slots + chunk % slots) * chunk_bytes;
  }
};

// What a wait is about, for the error raised when it times out.
struct WaitSite {
  const char* op;        // "all_gather" / "reduce_scatter"
  const char* what;      // "data from" / "ring space at"
  uint64_t op_seq;       // the group's collective sequence number
};

// What a wait also checks once its counters are reached: descs[i] (in this rank's window,
// stored by peer i with the data that counter announces) must hold `expected`, this
// rank's own descriptor, and then the number of the chunk waited for (the wait's target
// - 1). A mismatch fails the group with both sides named.
struct DescCheck {
  std::vector<const uint64_t*> descs;  // parallel to the wait's counters
  uint64_t expected = 0;
};

// A transport moves bytes and counters between windows. Work is issued on
// *lanes*: lane 0 is the operation's own ordering domain, lane i (1..world-1)
// carries the traffic with peer (rank + i) % world. A host transport executes
// immediately in issue order; a device transport enqueues each lane on a stream.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual char* window(int rank) = 0;
  // Block lane until every counter (in this rank's window) is >= target; then, with a
  // check, compare the peers' descriptors with this rank's.
  virtual void wait(int lane, const std::vector<const uint64_t*>& flags,
                    const std::vector<int>& peers, uint64_t target, const WaitSite& site,
                    const DescCheck* check = nullptr) = 0;
  // After everything issued on the lane before it, store value into each counter.
  virtual void signal(int lane, const std::vector<uint64_t*>& flags, uint64_t value) = 0;
  virtual void copy(int lane, void* dst, const void* src, size_t bytes) = 0;
  // dst[i] = spec.scale * sum_j srcs[j][i]
  virtual void reduce(int lane, void* dst, const std::vector<const void*>& srcs,
                      size_t numel, const ReduceSpec& spec) = 0;
  // Bracket one collective on `ring` (0: all-gather, 1: reduce-scatter): a device
  // transport forks its peer lanes from the operation's stream and joins them back
  // at the end, and orders the operation after the previous one on the same ring
  // when that ran on another stream (counters assume each ring's chunks in order).
  enum Ring : int { kAgRing = 0, kRsRing, kArenaGetRing, kArenaPutRing, kArenaSyncRing, kNumRings };
  virtual void begin_op(void* stream, Ring ring) {}
  virtual void end_op() {}
  // A failure recorded asynchronously (e.g. by a device-side wait), or "".
  virtual std::string async_error() { return {}; }
  // The peers' announcements the waits of the collective in progress watch (PeerWatch;
  // set by the protocol at a collective's first transfer, cleared at its end).
  void watch(const PeerWatch& w) { watch_ = w; }

  // ---- Decoupled mode: more regions per rank ("arenas", one per decoupled model),
  // created collectively; returns the arena's id.
  virtual int create_arena(size_t bytes) { unsupported("decoupled mode"); }
  virtual char* arena(int id, int rank) { unsupported("decoupled mode"); }
  // dst[i] += src[i] (src in `dtype`, dst fp32), safe while other ranks add into dst.
  virtual void accumulate(int lane, float* dst, const void* src, size_t numel, DType dtype) {
    unsupported("decoupled mode");
  }
  virtual void fill_zero(int lane, void* dst, size_t bytes) { unsupported("decoupled mode"); }
  // Whether accumulate() reaches every peer (NVSHMEM has no float atomics for routed peers).
  virtual bool accumulates_everywhere() const { return true; }

 protected:
  [[noreturn]] static void unsupported(const char* what);
  PeerWatch watch_;
};

// Drives the collectives over a transport. Chunk counters advance identically on
// every rank (ranks issue the same collectives in the same order, and each rank knows
// how many chunks every pair exchanges in each), so the counter value to wait for is
// known locally without any handshake. Every operation runs chunk-major (all of chunk
// k's sends before chunk k's receives), which keeps it deadlock-free even when a host
// transport executes it sequentially.
class Protocol {
 public:
  Protocol(int rank, int world, const WindowLayout& layout, Transport* transport);

  // out holds world * shard_bytes; in holds shard_bytes (may alias out's own part).
  // desc: this rank's op_desc() of the call, checked against every peer's (0: unchecked).
  void all_gather(void* out, const void* in, size_t shard_bytes, uint64_t op_seq,
                  uint64_t desc = 0);
  // in holds world * out_numel elements; out holds out_numel.
  void reduce_scatter(void* out, const void* in, size_t out_numel, size_t elem_size,
                      const ReduceSpec& spec, uint64_t op_seq, uint64_t desc = 0);
  // root's `bytes` of buf to every rank, through root's AG ring (a get from the root).
  void broadcast(void* buf, size_t bytes, int root, uint64_t op_seq, uint64_t desc = 0);
  // Point to point over the landing rings: send[p] bytes at in + send_off[p] to each rank
  // p, recv[p] bytes from each p to out + recv_off[p] (the own pair is a local copy). Each
  // pair is checked with its own descriptor (kind, dtype, that pair's bytes, root). With
  // talk_empty, pairs with nothing to send still exchange one empty chunk (all-to-all: a
  // peer that expects bytes must see the mismatch); otherwise empty pairs are skipped.
  struct Exchange {
    std::vector<size_t> send, send_off, recv, recv_off;
    OpKind kind = OpKind::AllToAll;
    int scalar_type = 0;
    int root = 0;
    bool check = false;
    bool talk_empty = false;
  };
  void exchange(void* out, const void* in, const Exchange& x, uint64_t op_seq);

  // Bracket one collective of the group (the backend's launch): numbers it, and lets its
  // first transfer announce it to the peers (kAnnounceSlots). Decoupled mode's one-sided
  // operations are not collectives: they are never numbered or announced.
  // A collective that failed before its first transfer (an argument error) gives its
  // number back: the ranks' numbers stay in step.
  void begin_collective();
  void end_collective(bool failed = false);

  const WindowLayout& layout() const { return layout_; }

 private:
  uint64_t* flag_in(int owner, WindowLayout::Flag kind, int index);
  uint64_t* desc_in(int owner, WindowLayout::Desc kind, int peer, uint64_t chunk);
  std::vector<int> peers_but_me() const;
  uint64_t chunks(size_t bytes, bool at_least_one) const;
  // At a collective's first transfer: store its announcement (desc without the byte count;
  // 0: unchecked, nothing announced) in every peer's window and watch theirs.
  void announce(uint64_t desc);
  // Before announcing chunk g: store the descriptor and g where the waiting ranks check them.
  void store_desc(int lane, const std::vector<uint64_t*>& at, uint64_t desc, uint64_t g);
  // Put chunk g of mine into p's landing ring (waiting for the slot), with its descriptor.
  void put_chunk(int lane, int p, uint64_t g, const char* src, size_t len, uint64_t desc,
                 const char* op, uint64_t op_seq);

  int rank_;
  int world_;
  WindowLayout layout_;
  Transport* t_;
  std::vector<uint64_t> ag_pub_;     // per owner: chunks it published into its AG ring
  std::vector<uint64_t> rs_sent_;    // per peer: chunks this rank put into its landing ring
  std::vector<uint64_t> rs_landed_;  // per peer: chunks it put into this rank's landing ring
  uint64_t collectives_ = 0;          // collectives begun on this channel
  bool unannounced_ = false;          // the one in progress has not announced itself yet
};

// Decoupled mode's persistent state, per rank: for every parameter group g the
// rank's published parameter shard (param dtype) and its fp32 gradient accumulator,
// plus two counter arrays: Done[src] (in the owner's arena: the epoch up to which
// src has put all its contributions) and Pub[owner] (in a reader's arena: the epoch
// the owner's published shards belong to).
struct ArenaLayout {
  static constexpr size_t kFlagStride = 128;
  enum Flag : int { Done = 0, Pub, kNumFlagArrays };

  ArenaLayout() = default;
  ArenaLayout(int world, const std::vector<size_t>& shard_numel,
              const std::vector<size_t>& param_elem_size, const std::vector<size_t>& grad_numel);

  int world = 0;
  std::vector<size_t> numel;      // per group: elements of one rank's (padded) shard
  std::vector<size_t> grad_numel; // per group: elements of its trainable part (accumulator)
  std::vector<size_t> pub_bytes;  // per group: bytes of the published shard
  std::vector<size_t> pub_off, acc_off;
  size_t total = 0;

  size_t flag(Flag kind, int index) const {
    return (static_cast<size_t>(kind) * world + index) * kFlagStride;
  }
};

// Between two syncs: get() reads owners' published shards (waiting only until they
// announced the epoch), accumulate() adds into owners' accumulators (never waits).
// finish() is the minibatch's one synchronisation; take() then reads and clears this
// rank's accumulator; publish() + announce() make the next epoch's shards readable.
// Group indices are validated by the caller (OdcBackend::arena_at).
class Arena {
 public:
  Arena(int rank, int world, ArenaLayout layout, Transport* transport, int id);

  const ArenaLayout& layout() const { return layout_; }
  void publish(int group, const void* shard);
  void announce(uint64_t epoch);
  void get(int group, void* out, uint64_t epoch, uint64_t op_seq);  // out: world shards
  void accumulate(int group, const void* in, DType dtype);          // in: world shards
  void finish(uint64_t epoch, uint64_t op_seq);
  void take(int group, float* out);

 private:
  uint64_t* flag_in(int owner, ArenaLayout::Flag kind, int index);

  char* base(int rank) { return t_->arena(id_, rank); }

  int rank_;
  int world_;
  ArenaLayout layout_;
  Transport* t_;
  int id_;
};

}  // namespace odc
