// Layer 1, layout and descriptors: the byte layouts of a window and of a decoupled-mode
// arena (identical on every rank), the element types and reductions, and the 64-bit
// descriptor of a collective that ranks compare. Plain data; depends on nothing of odc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace odc {

enum class RedOp : int { Sum = 0, Avg = 1, PreMulSum = 2, Max = 3, Min = 4, Product = 5 };
// Element types a reduction handles (FSDP's reduce-scatters use the first three).
enum class DType : int { F32 = 0, BF16 = 1, F16 = 2, F64 = 3, I32 = 4, I64 = 5, U8 = 6, I8 = 7 };

const char* dtype_name(DType d);
size_t dtype_size(DType d);

// A collective's descriptor: one 64-bit word that every rank of the group computes for
// its own call and checks against its peers'. 0 means "not checked" (ODC_MATCH_CHECK=0).
//   bit 63: set (a descriptor, never a stale zero)   bits 59-62: kind
//   bits 56-58: reduce op (1 + RedOp; 0: none)       bits 48-55: element type (c10 ScalarType)
//   bits 40-47: root (broadcast, scatter, gather)    bits 0-39: bytes (per rank, or per pair)
// The *Registered kinds are the zero-copy forms (inputs in registered memory: pool.hpp); a
// rank that runs one while a peer runs the staged form is another collective to the peer.
enum class OpKind : int {
  AllGather = 1, ReduceScatter, AllReduce, Broadcast, AllToAll, Scatter, Gather,
  AllGatherRegistered, ReduceScatterRegistered, AllGatherRegisteredPush, AllGatherPut,
  AllGatherDirect, ReduceScatterDirect
};
const char* kind_name(OpKind kind);  // "all_gather", "all_gather (registered memory)"
uint64_t op_desc(OpKind kind, int scalar_type, uint64_t bytes, int red_op, int root = 0);
struct OpDescFields {
  OpKind kind;
  int scalar_type;
  uint64_t bytes;
  int red_op;  // 0, or 1 + RedOp
  int root;
};
OpDescFields decode_op_desc(uint64_t desc);

// The second word stored with a registered collective's descriptor (where the chunk number
// goes for ring collectives): where the buffer its peers read lies in the rank's registered
// pool, and the collective's number on its ring. Ranks compare it like the descriptor.
struct RegisteredId {
  uint64_t offset = 0;  // bytes into the pool of the buffer read: a reduce-scatter's input, an
                        // all-gather's whole output (its input is this rank's part of it)
  uint64_t number = 0;  // 1, 2, ... (low 20 bits kept)
  uint64_t encode() const {
    return (number & 0xFFFFF) << 44 | (offset & ((uint64_t{1} << 44) - 1));
  }
  static RegisteredId decode(uint64_t w) { return {w & ((uint64_t{1} << 44) - 1), w >> 44}; }
};

#ifdef __CUDACC__
#define ODC_HOST_DEVICE __host__ __device__
#else
#define ODC_HOST_DEVICE
#endif

// Where the input of a direct collective (Protocol::all_gather_direct) lies, as its owner
// stores it in each reader's window before its "ready" (a pushed direct all-gather also says
// so of a rank's output, for its peers to write their shards there): in the owner's allocator
// segment `slot` of generation `gen` (SegmentTable: the readers have it mapped), `offset` bytes
// in; or, with `mapped` clear, round by round in the owner's window (the staged fallback; for
// an output: the rank reads its peers' shards itself).
//   bit 63: mapped   bits 51-62: slot   bits 40-50: generation (low 11 bits)   bits 0-39: offset
constexpr int kSegmentSlots = 1024;  // allocator segments a rank shares at once
struct Location {
  bool mapped = false;
  uint32_t slot = 0;
  uint64_t gen = 0;
  uint64_t offset = 0;
  static constexpr uint64_t kGenMask = 0x7FF;
  static constexpr uint64_t kOffsetMask = (uint64_t{1} << 40) - 1;
  uint64_t encode() const {
    if (!mapped) return 0;
    return uint64_t{1} << 63 | (uint64_t{slot} & 0xFFF) << 51 | (gen & kGenMask) << 40 |
           (offset & kOffsetMask);
  }
  ODC_HOST_DEVICE static Location decode(uint64_t w) {
    Location l;
    l.mapped = w >> 63;
    l.slot = static_cast<uint32_t>((w >> 51) & 0xFFF);
    l.gen = (w >> 40) & kGenMask;
    l.offset = w & kOffsetMask;
    return l;
  }
};

// Every collective a rank starts is *announced* to each peer before its first transfer:
// one word in the peer's window, slot [announcer][number % kAnnounceSlots], holding the
// collective's kind (its descriptor's kind bits: dtype, sizes, reduce op and root are
// checked with the data) and, in the low 40 bits, the collective's number on that channel
// (1, 2, ...; ranks issue the same collectives in the same order, so the numbers agree).
// A wait that spins on a peer also watches the slot of that peer for its own number: a
// peer that announced a *different* collective under the same number (one rank
// all-gathers while the other reduce-scatters) fails the wait at once, naming both,
// instead of after the group's timeout.
constexpr int kAnnounceSlots = 16;
constexpr uint64_t kAnnounceSeqMask = (uint64_t{1} << 40) - 1;
constexpr uint64_t kAnnounceKindBits = uint64_t{31} << 59;  // bit 63 (a descriptor) and the kind
inline uint64_t announce_word(uint64_t desc, uint64_t number) {
  return (desc & kAnnounceKindBits) | (number & kAnnounceSeqMask);
}
// What a wait watches while it spins (no watch: slots == nullptr); the host waits and the
// GPU wait kernels use the same two rules.
struct PeerWatch {
  const uint64_t* slots = nullptr;  // this rank's announce slots, [world][kAnnounceSlots]
  uint64_t word = 0;                // this rank's own announcement of the collective
  ODC_HOST_DEVICE const uint64_t* slot_of(int peer) const {
    return slots + static_cast<size_t>(peer) * kAnnounceSlots + (word & kAnnounceSeqMask) % kAnnounceSlots;
  }
  // Whether `theirs` (read from slot_of(peer)) announces another collective under our number.
  ODC_HOST_DEVICE bool differs(uint64_t theirs) const {
    return (theirs & kAnnounceSeqMask) == (word & kAnnounceSeqMask) && theirs != word;
  }
};

// A rank that gives up a collective (one of its waits failed: a timeout, a mismatch, another
// collective announced, or a peer that gave up) stores in its announcement slot of every peer
// its announcement of that collective with this bit, and why (the failure's code, below): a
// peer whose wait depends on it then fails at once (PeerWatch::differs holds), naming it,
// rather than waiting for a counter it will never store until the group's timeout. Without it
// a rank that found a mismatch on one lane left its other lanes' later signals unsent, and the
// peers that could only learn of the mismatch from those waited out the timeout.
constexpr uint64_t kAnnounceStopped = uint64_t{1} << 58;
constexpr int kStopCodeShift = 52;  // 3 bits, the failure's code (kernels.cuh, DeviceError)
ODC_HOST_DEVICE inline uint64_t stopped_word(uint64_t announced, int code) {
  return announced | kAnnounceStopped | (static_cast<uint64_t>(code & 7) << kStopCodeShift);
}
ODC_HOST_DEVICE inline bool is_stopped(uint64_t word) { return (word & kAnnounceStopped) != 0; }
// A peer that gave up the same kind of collective (else it called another one: that is the news).
ODC_HOST_DEVICE inline bool gave_up_same(uint64_t mine, uint64_t theirs) {
  return is_stopped(theirs) && (theirs & kAnnounceKindBits) == (mine & kAnnounceKindBits);
}
ODC_HOST_DEVICE inline int stop_code(uint64_t word) { return static_cast<int>((word >> kStopCodeShift) & 7); }
// The failure codes (the GPU's DeviceError and the host's alike).
enum StopCode : int { kStopTimeout = 1, kStopMismatch = 2, kStopAnnounced = 3, kStopMemory = 4,
                      kStopPeerStopped = 5, kStopExited = 6 };

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
  bool reads_peers = false;            // sources in peers' memory (zero-copy), not this rank's window
};

// Byte layout of a window; identical on every rank of a group.
struct WindowLayout {
  static constexpr size_t kFlagStride = 128;  // one counter per 128-byte line
  // Ring collectives: AgReady/AgAck (AG ring), RsReady/RsFree (landing rings). Registered
  // (zero-copy) collectives: RegReady[ring][peer] (the peer's input is ready for its n-th
  // registered collective on that ring) and RegDone[ring][peer] (the peer has read this
  // rank's input of it); ring 0 all-gathers, ring 1 reduce-scatters. Direct collectives use
  // the same counters and store the peer's Location word in RegAgWhere / RegRsWhere[peer];
  // a pushed direct all-gather also stores where the peer's output lies in RegAgOut[peer].
  enum Flag : int { AgReady = 0, AgAck, RsReady, RsFree, RegAgReady, RegAgDone, RegRsReady,
                    RegRsDone, RegAgWhere, RegRsWhere, RegAgOut, kNumFlagArrays };
  enum Desc : int { AgDesc = 0, RsDesc, RegAgDesc, RegRsDesc, kNumDescArrays };

  WindowLayout() = default;
  WindowLayout(int world, size_t chunk_bytes, int slots);

  int world = 0;
  size_t chunk_bytes = 0;
  int slots = 0;
  size_t flags_bytes = 0;  // the counters come first
  // Offset of the descriptors: per kind, peer and ring slot, 16 bytes: the descriptor and
  // the sequence number of the chunk it came with (registered collectives: registered_id).
  static constexpr size_t kDescBytes = 16;
  size_t descs = 0;
  size_t announce = 0;  // offset of the announce slots: [world][kAnnounceSlots] words
  // The rings come last, from ag_ring to total: a transport may keep them apart from the
  // counters (Transport::window), to give them back while the group holds no arena.
  size_t ag_ring = 0;  // offset of the AG ring (slots * chunk_bytes)
  size_t rs_ring = 0;  // offset of the RS landing rings (world * slots * chunk_bytes)
  size_t total = 0;
  size_t rings_bytes() const { return total - ag_ring; }

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

// Decoupled mode's persistent state, per rank: for every parameter group g the
// rank's published parameter shard (param dtype) and its fp32 gradient accumulator,
// plus counter arrays: Done[src] (in the owner's arena: the epoch up to which src has
// put all its contributions), Pub[owner] (in a reader's arena: the epoch the owner's
// published shards belong to) and, per group g, GroupDone[g][src] (in the owner's arena:
// the epoch up to which src has put all its contributions to g).
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
  size_t group_done(int group, int index) const {
    return ((static_cast<size_t>(kNumFlagArrays) + group) * world + index) * kFlagStride;
  }
};

}  // namespace odc
