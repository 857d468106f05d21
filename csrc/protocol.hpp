// Layer 3, protocol and arena: the one-sided protocol shared by every transport.
// Depends on the layout (layout.hpp) and the transport interface (transport.hpp).
//
// Each rank owns a *window*: memory its peers can read and write directly (host
// shared memory, or GPU memory through CUDA IPC or NVSHMEM). A window holds
// monotonically increasing 64-bit counters ("flags") and two data rings:
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

#include <cstddef>
#include <cstdint>
#include <functional>
#include <unordered_map>
#include <exception>  // std::uncaught_exceptions
#include <vector>

#include "layout.hpp"
#include "transport.hpp"

namespace odc {

// Drives the collectives over a transport. Chunk counters advance identically on
// every rank (ranks issue the same collectives in the same order, and each rank knows
// how many chunks every pair exchanges in each), so the counter value to wait for is
// known locally without any handshake. Every operation runs chunk-major (all of chunk
// k's sends before chunk k's receives), which keeps it deadlock-free even when a host
// transport executes it sequentially.
class Protocol {
 public:
  // zero_copy: the transport's reads in place (null: no direct collectives).
  Protocol(int rank, int world, const WindowLayout& layout, Transport* transport,
           ZeroCopyReads* zero_copy);

  // out holds world * shard_bytes; in holds shard_bytes (may alias out's own part).
  // desc: this rank's op_desc() of the call, checked against every peer's (0: unchecked).
  void all_gather(void* out, const void* in, size_t shard_bytes, uint64_t op_seq,
                  uint64_t desc = 0);
  // in holds world * out_numel elements; out holds out_numel.
  void reduce_scatter(void* out, const void* in, size_t out_numel, size_t elem_size,
                      const ReduceSpec& spec, uint64_t op_seq, uint64_t desc = 0);
  // Zero-copy forms, for inputs in registered memory (pool.hpp): in_at[r] is rank r's input,
  // mapped here (each rank's at the same place of its pool: `id`, without its number, says
  // where, and the peers check it). A rank stores "input ready" in each peer's window, reads
  // the peers' inputs where they lie (all-gather: copies each peer's shard; reduce-scatter:
  // sums its part of every rank's input, in rank order, as the ring form does), tells each
  // peer it is done, and completes once every peer is done with its input: as with NCCL, the
  // input may be reused once the call has completed.
  // all_gather_pushed: each rank instead writes its own shard `in` into every peer's output
  // out_at[p] (which lies at the same place of that peer's pool: the id check guarantees it)
  // once the peer said its output is ready, through Transport::put_after (never on a failed
  // check); "done" then means "my shard is in your output". NVLink writes run at nearly twice
  // the speed of reads from three peers at once (performance.md). Every rank must choose the
  // same way: the pushed form's descriptor is of its own kind.
  void all_gather_registered(void* out, const std::vector<const char*>& in_at,
                             size_t shard_bytes, RegisteredId id, uint64_t op_seq,
                             uint64_t desc = 0);
  void all_gather_pushed(void* out, const void* in, const std::vector<const char*>& out_at,
                         size_t shard_bytes, RegisteredId id, uint64_t op_seq, uint64_t desc = 0);
  void reduce_scatter_registered(void* out, const std::vector<const char*>& in_at,
                                 size_t out_numel, size_t elem_size, const ReduceSpec& spec,
                                 RegisteredId id, uint64_t op_seq, uint64_t desc = 0);
  // Direct forms, for memory allocated anywhere (ZeroCopyReads, transport.hpp): each rank's
  // input is read where it lies when every peer has its allocator segment mapped, else staged
  // through its own window in rounds of slots * chunk_bytes. The owner of an input alone
  // decides (`where`: its Transport::locate word, 0 to stage) and says so in the Location word
  // it stores with its "ready"; the readers' copies take their source from that word on the
  // device, so their hosts need no peer address and the ranks cannot disagree. Counters and
  // completion are the registered forms': a round is one registered number, and a call
  // completes once every peer is done reading this rank's input.
  // Pushed (`out_where` set: the group pushes all-gathers, and then `desc` is always set): each
  // rank also stores where its output lies (*out_where, 0 where not every peer has it mapped);
  // once a peer said "ready", this rank writes its shard into that peer's output where its word
  // says (push_located), or leaves it to the peer, whose word said "not mapped", to read. A rank
  // whose output is mapped reads nothing and tells each peer "done" (for every round) after its
  // push there, which is also after its last read of the peer's words; one whose output is not
  // reads as above. Either way, each rank's "done" to a peer follows everything it did to the
  // peer's input and output, so a call still completes at the "done" of every peer.
  void all_gather_direct(void* out, const void* in, size_t shard_bytes, uint64_t where,
                         uint64_t op_seq, uint64_t desc = 0, const uint64_t* out_where = nullptr);
  void reduce_scatter_direct(void* out, const void* in, size_t out_numel, size_t elem_size,
                             const ReduceSpec& spec, uint64_t where, uint64_t op_seq,
                             uint64_t desc = 0);
  // root's `bytes` of buf to every rank, through root's AG ring (a get from the root).
  void broadcast(void* buf, size_t bytes, int root, uint64_t op_seq, uint64_t desc = 0);
  // Point to point over the landing rings: send[p] bytes at in + send_off[p] to each rank
  // p, recv[p] bytes from each p to out + recv_off[p] (the own pair is a local copy). Each
  // pair is checked with its own descriptor (kind, dtype, that pair's bytes, root). With
  // talk_empty, pairs with nothing to send still exchange one empty chunk (all-to-all: a
  // peer that expects bytes must see the mismatch); otherwise empty pairs are skipped.
  // The staged all-gather pushed (ODC_STAGED_AG_PUSH, kind AllGatherPut) is one: this rank's
  // shard to every peer, writes instead of the peers' reads from its all-gather ring.
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
  // That bracket for a scope: the collective ends failed where an exception leaves it.
  class Collective {
   public:
    explicit Collective(Protocol& p) : p_(p) { p_.begin_collective(); }
    ~Collective() { p_.end_collective(std::uncaught_exceptions() > unwinding_); }
    Collective(const Collective&) = delete;
    Collective& operator=(const Collective&) = delete;

   private:
    Protocol& p_;
    const int unwinding_ = std::uncaught_exceptions();
  };
  // One operation of the transport within the collective (Transport::begin_op / end_op on
  // `ring`, and `also`): what `body` issues runs as one, fused or on the copy engines. Not
  // ended where body throws (the group is then broken).
  template <typename F>
  void operation(void* stream, Ring ring, F&& body, Ring also = Ring::kNone) {
    t_->begin_op(stream, ring, also);
    body();
    t_->end_op();
  }
  // The direct collectives' owner side (ZeroCopyReads::locate); 0 without them.
  uint64_t locate(const void* p, size_t bytes) { return zero_copy_ ? zero_copy_->locate(p, bytes) : 0; }
  bool reads_in_place() const { return zero_copy_ != nullptr; }
  // What ran the last operation (the group's stats).
  Transport::EngineUse last_engine() const { return t_->last_engine(); }

  const WindowLayout& layout() const { return layout_; }

 private:
  uint64_t* flag_in(int owner, WindowLayout::Flag kind, int index);
  // The window's ring bytes at `offset` (layout_.ag_slot / rs_slot / ag_ring) of `owner`.
  char* ring_at(int owner, size_t offset) {
    return t_->window(owner, Transport::kRings) + (offset - layout_.ag_ring);
  }
  uint64_t* desc_in(int owner, WindowLayout::Desc kind, int peer, uint64_t chunk);
  uint64_t chunks(size_t bytes, bool at_least_one) const;
  // At a collective's first transfer: store its announcement (desc without the byte count;
  // 0: unchecked, nothing announced) in every peer's window and watch theirs.
  void announce(uint64_t desc);
  // Before announcing chunk g: store the descriptor and g where the waiting ranks check them.
  void store_desc(int lane, const std::vector<uint64_t*>& at, uint64_t desc, uint64_t g);
  // Put chunk g of mine into p's landing ring (waiting for the slot), with its descriptor.
  void put_chunk(int lane, int p, uint64_t g, const char* src, size_t len, uint64_t desc,
                 const char* op, uint64_t op_seq);
  // Registered collectives on `ring` (Ring::kAllGather or kReduceScatter): "input ready" (with
  // the descriptor and id) to every peer; on `lane`, wait for `peers`' "input ready"; tell
  // `peers` this rank is done reading them; wait (lane 0) until every peer is done.
  void registered_ready(Ring ring, RegisteredId id, uint64_t desc);
  void registered_wait_ready(Ring ring, int lane, const std::vector<int>& peers, RegisteredId id,
                             uint64_t desc, const WaitSite& site);
  // The check of `peers`' "input ready": their descriptors against `desc`, with `id`.
  DescCheck registered_check(Ring ring, const std::vector<int>& peers, RegisteredId id,
                             uint64_t desc);
  void registered_done(Ring ring, int lane, const std::vector<int>& peers, uint64_t number);
  void registered_finish(Ring ring, const std::vector<int>& peers, uint64_t number,
                         const WaitSite& site);
  // A direct collective's rounds for `bytes` per peer (at least one). "ready" up to `ready`
  // (a registered number) to every peer, after the Location word and descriptor at the
  // first round (id.number) or in place. The owner's side of round r: in place, "ready" for
  // every round at the first; staged, once its readers are done with the last round (waited
  // at reads_site), `stage` issues this round's copies into its window, then "ready" for it.
  // `out_where`: a pushed all-gather's output word, stored with the Location word.
  uint64_t direct_rounds(size_t bytes) const;
  // Where peer's output of pushed all-gather `number` is expected to lie (its Location word;
  // 0: no guess), from what it published (ZeroCopyReads::published_output); `mine`: this rank's.
  uint64_t guess_output(int peer, uint64_t number, uint64_t mine);
  void direct_ready(Ring ring, uint64_t where, RegisteredId id, uint64_t desc, uint64_t ready,
                    const uint64_t* out_where);
  void direct_round(Ring ring, uint64_t r, uint64_t rounds, uint64_t where, RegisteredId id,
                    uint64_t desc, const WaitSite& reads_site, const std::function<void()>& stage,
                    const uint64_t* out_where = nullptr);

  int rank_;
  int world_;
  WindowLayout layout_;
  Transport* t_;
  ZeroCopyReads* zero_copy_;
  std::vector<uint64_t> ag_pub_;     // per owner: chunks it published into its AG ring
  // Pushed all-gathers, per output word of this rank: its latest calls there, and per peer the
  // newest word that peer published for one of them (guess_output).
  struct OutputHistory {
    std::vector<uint64_t> numbers;  // oldest first, at most kOutputHistory
    std::vector<uint64_t> known;    // per peer (0: none yet)
  };
  static constexpr size_t kOutputHistory = 16;
  std::unordered_map<uint64_t, OutputHistory> output_history_;
  std::vector<uint64_t> rs_sent_;    // per peer: chunks this rank put into its landing ring
  std::vector<uint64_t> rs_landed_;  // per peer: chunks it put into this rank's landing ring
  std::vector<int> others_;             // every rank but this one (made once: used per call)
  std::vector<std::vector<int>> only_;  // only_[p] = {p}
  // registered (and direct) all-gathers and reduce-scatters issued, per Ring::kAllGather and
  // Ring::kReduceScatter
  uint64_t registered_[2] = {0, 0};
  uint64_t& registered_count(Ring ring) { return registered_[ring_index(ring)]; }
  uint64_t collectives_ = 0;          // collectives begun on this channel
  bool unannounced_ = false;          // the one in progress has not announced itself yet
};

}  // namespace odc
