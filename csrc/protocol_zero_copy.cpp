// Layer 3, protocol and arena: the zero-copy forms of the protocol (protocol.hpp): registered
// collectives (inputs in registered memory, at the same place of every rank's pool) and direct
// ones (inputs anywhere, read where their owners say).
#include <algorithm>
#include <functional>
#include <vector>

#include "protocol.hpp"

namespace odc {

// ---- Registered (zero-copy) collectives: the rank's input is read where it lies.

namespace {
// The window's words of a ring's registered and direct collectives (all-gathers or
// reduce-scatters).
struct RingWords {
  WindowLayout::Flag ready, done, where;
  WindowLayout::Desc desc;
};
RingWords words_of(Ring ring) {
  return ring == Ring::kAllGather
             ? RingWords{WindowLayout::RegAgReady, WindowLayout::RegAgDone, WindowLayout::RegAgWhere,
                         WindowLayout::RegAgDesc}
             : RingWords{WindowLayout::RegRsReady, WindowLayout::RegRsDone, WindowLayout::RegRsWhere,
                         WindowLayout::RegRsDesc};
}
constexpr Ring kAg = Ring::kAllGather;
constexpr Ring kRs = Ring::kReduceScatter;
}  // namespace

void Protocol::registered_ready(Ring ring, RegisteredId id, uint64_t desc) {
  std::vector<uint64_t*> ready, descs;
  for (int p : others_) {
    ready.push_back(flag_in(p, words_of(ring).ready, rank_));
    descs.push_back(desc_in(p, words_of(ring).desc, rank_, id.number - 1));
  }
  if (desc) store_desc(0, descs, desc, id.encode());
  t_->signal(0, ready, id.number);
}

DescCheck Protocol::registered_check(Ring ring, const std::vector<int>& peers, RegisteredId id,
                                    uint64_t desc) {
  DescCheck check{{}, desc, id.encode()};  // every peer's buffer lies where this rank's does
  for (int p : peers) check.descs.push_back(desc_in(rank_, words_of(ring).desc, p, id.number - 1));
  return check;
}

void Protocol::registered_wait_ready(Ring ring, int lane, const std::vector<int>& peers,
                                     RegisteredId id, uint64_t desc, const WaitSite& site) {
  std::vector<const uint64_t*> ready;
  for (int p : peers) ready.push_back(flag_in(rank_, words_of(ring).ready, p));
  const DescCheck check = registered_check(ring, peers, id, desc);
  t_->wait(lane, ready, peers, id.number, site, desc ? &check : nullptr);
}

void Protocol::registered_done(Ring ring, int lane, const std::vector<int>& peers,
                               uint64_t number) {
  std::vector<uint64_t*> at;
  for (int p : peers) at.push_back(flag_in(p, words_of(ring).done, rank_));
  t_->signal(lane, at, number);
}

void Protocol::registered_finish(Ring ring, const std::vector<int>& peers, uint64_t number,
                                 const WaitSite& site) {
  std::vector<const uint64_t*> done;
  for (int p : peers) done.push_back(flag_in(rank_, words_of(ring).done, p));
  t_->wait(0, done, peers, number, site);
}

void Protocol::all_gather_registered(void* out, const std::vector<const char*>& in_at,
                                     size_t shard_bytes, RegisteredId id, uint64_t op_seq,
                                     uint64_t desc) {
  char* out_b = static_cast<char*>(out);
  char* my_part = out_b + static_cast<size_t>(rank_) * shard_bytes;
  announce(desc);
  if (world_ > 1) {
    id.number = ++registered_count(kAg);
    registered_ready(kAg, id, desc);
    for (int i = 1; i < world_; ++i) {  // each peer on its lane
      const int p = (rank_ + i) % world_;
      registered_wait_ready(kAg, i, only_[p], id, desc, {"all_gather", "the input of", op_seq});
      if (shard_bytes) t_->copy(i, out_b + static_cast<size_t>(p) * shard_bytes, in_at[p], shard_bytes);
      registered_done(kAg, i, only_[p], id.number);
    }
  }
  if (my_part != in_at[rank_] && shard_bytes) t_->copy(0, my_part, in_at[rank_], shard_bytes);
  if (world_ > 1) {
    registered_finish(kAg, others_, id.number, {"all_gather", "the reads of this rank's input by", op_seq});
  }
}

void Protocol::all_gather_pushed(void* out, const void* in, const std::vector<const char*>& out_at,
                                 size_t shard_bytes, RegisteredId id, uint64_t op_seq,
                                 uint64_t desc) {
  const size_t mine = static_cast<size_t>(rank_) * shard_bytes;  // this rank's part of an output
  char* my_part = static_cast<char*>(out) + mine;
  announce(desc);
  if (world_ > 1) {
    id.number = ++registered_count(kAg);
    registered_ready(kAg, id, desc);
    for (int i = 1; i < world_; ++i) {  // each peer on its lane: this rank's shard into its output
      const int p = (rank_ + i) % world_;
      const DescCheck check = registered_check(kAg, only_[p], id, desc);
      t_->put_after(i, flag_in(rank_, words_of(kAg).ready, p), p, id.number,
                    {"all_gather", "the output of", op_seq}, desc ? &check : nullptr,
                    const_cast<char*>(out_at[p]) + mine, in, shard_bytes,
                    flag_in(p, words_of(kAg).done, rank_));
    }
  }
  if (my_part != in && shard_bytes) t_->copy(0, my_part, in, shard_bytes);
  if (world_ > 1) {
    registered_finish(kAg, others_, id.number,
                      {"all_gather", "the shard pushed into this rank's output by", op_seq});
  }
}

void Protocol::reduce_scatter_registered(void* out, const std::vector<const char*>& in_at,
                                         size_t out_numel, size_t elem_size,
                                         const ReduceSpec& spec, RegisteredId id,
                                         uint64_t op_seq, uint64_t desc) {
  announce(desc);
  const size_t part_bytes = out_numel * elem_size;
  const std::vector<int>& peers = others_;
  if (world_ > 1) {
    id.number = ++registered_count(kRs);
    registered_ready(kRs, id, desc);
    registered_wait_ready(kRs, 0, peers, id, desc, {"reduce_scatter", "the input of", op_seq});
  }
  std::vector<const void*> srcs;  // this rank's part of every rank's input, in rank order
  for (int r = 0; r < world_; ++r) srcs.push_back(in_at[r] + static_cast<size_t>(rank_) * part_bytes);
  ReduceSpec from_peers = spec;
  from_peers.reads_peers = world_ > 1;
  if (out_numel) t_->reduce(0, out, srcs, out_numel, from_peers);
  if (world_ > 1) {
    registered_done(kRs, 0, peers, id.number);
    registered_finish(kRs, peers, id.number, {"reduce_scatter", "the reads of this rank's input by", op_seq});
  }
}

// ---- Direct collectives: each input read where its owner says (protocol.hpp).

uint64_t Protocol::direct_rounds(size_t bytes) const {
  const size_t round = layout_.chunk_bytes * layout_.slots;
  return std::max<uint64_t>(1, (bytes + round - 1) / round);
}

void Protocol::direct_ready(Ring ring, uint64_t where, RegisteredId id, uint64_t desc,
                            uint64_t ready, const uint64_t* out_where) {
  std::vector<uint64_t*> at, outs, readies, descs;
  for (int p : others_) {
    at.push_back(flag_in(p, words_of(ring).where, rank_));
    if (out_where) outs.push_back(flag_in(p, WindowLayout::RegAgOut, rank_));
    readies.push_back(flag_in(p, words_of(ring).ready, rank_));
    descs.push_back(desc_in(p, words_of(ring).desc, rank_, id.number - 1));
  }
  if (ready == id.number || where) {  // the first round: where the input (and output) lies, what it is
    t_->store(0, at, where);
    if (out_where) t_->store(0, outs, *out_where);
    if (desc) store_desc(0, descs, desc, id.encode());
  }
  t_->signal(0, readies, ready);
}

void Protocol::direct_round(Ring ring, uint64_t r, uint64_t rounds, uint64_t where, RegisteredId id,
                            uint64_t desc, const WaitSite& reads_site,
                            const std::function<void()>& stage, const uint64_t* out_where) {
  const uint64_t base = id.number - 1;
  if (where) {
    if (r == 0) direct_ready(ring, where, id, desc, base + rounds, out_where);  // in place: all at once
    return;
  }
  if (r) registered_finish(ring, others_, base + r, reads_site);  // its readers took the last round
  stage();
  direct_ready(ring, 0, id, desc, base + r + 1, out_where);
}

void Protocol::all_gather_direct(void* out, const void* in, size_t shard_bytes, uint64_t where,
                                 uint64_t op_seq, uint64_t desc, const uint64_t* out_where) {
  char* out_b = static_cast<char*>(out);
  const char* in_b = static_cast<const char*>(in);
  const size_t mine = static_cast<size_t>(rank_) * shard_bytes;  // this rank's part of an output
  char* my_part = out_b + mine;
  announce(desc);
  const size_t round = layout_.chunk_bytes * layout_.slots;
  const uint64_t rounds = direct_rounds(shard_bytes);
  const uint64_t base = registered_count(kAg);
  const bool pushes = out_where != nullptr;
  const bool reads_peers = !pushes || *out_where == 0;  // else its peers push into its output
  const WaitSite reads{"all_gather", reads_peers ? "the reads of this rank's input by"
                                                 : "the reads of this rank's input or the pushes into its output by",
                       op_seq};
  auto len_of = [&](uint64_t r) { return std::min(round, shard_bytes - std::min(r * round, shard_bytes)); };
  if (world_ > 1) {
    registered_count(kAg) += rounds;
    const RegisteredId id{0, base + 1};
    char* stage = ring_at(rank_, layout_.ag_ring);
    if (pushes && *out_where) zero_copy_->publish_output(base + 1, *out_where);
    // Round-major (each round's staging, then its reads), which keeps the order deadlock-free
    // when run in sequence: a rank's next staging waits only for reads its peers issued before
    // they wait for its next round.
    for (uint64_t r = 0; r < rounds; ++r) {
      direct_round(kAg, r, rounds, where, id, desc, reads, [&] {  // staged in its all-gather ring,
        if (r == 0 && ag_pub_[rank_]) {  // once its readers took what was published there
          std::vector<const uint64_t*> acks;
          for (int p : others_) acks.push_back(flag_in(rank_, WindowLayout::AgAck, p));
          t_->wait(0, acks, others_, ag_pub_[rank_], {"all_gather", "ring space held by", op_seq});
        }
        if (len_of(r)) t_->copy(0, stage, in_b + r * round, len_of(r));
      }, out_where);
      for (int i = 1; i < world_; ++i) {  // each peer on its lane
        if (!reads_peers && r > 0) break;  // its one round: the push
        const int p = (rank_ + i) % world_;
        const DescCheck check = registered_check(kAg, only_[p], id, desc);
        t_->wait(i, {flag_in(rank_, words_of(kAg).ready, p)}, only_[p], base + r + 1,
                 {"all_gather", pushes ? "the input or output of" : "the input of", op_seq},
                 r == 0 && desc ? &check : nullptr);
        if (pushes && r == 0 && shard_bytes) {  // this rank's shard into p's output, if p says where
          const Located dst{flag_in(rank_, WindowLayout::RegAgOut, p), p, nullptr, mine};
          zero_copy_->push_located(i, dst, in_b, shard_bytes, guess_output(p, base + 1, *out_where));
        }
        if (reads_peers && len_of(r)) {
          const Located src{flag_in(rank_, words_of(kAg).where, p), p,
                            ring_at(p, layout_.ag_ring), r * round};
          zero_copy_->copy_located(i, out_b + static_cast<size_t>(p) * shard_bytes + r * round, src, len_of(r));
        }
        registered_done(kAg, i, only_[p], reads_peers ? base + r + 1 : base + rounds);
      }
    }
  }
  if (my_part != in_b && shard_bytes) t_->copy(0, my_part, in_b, shard_bytes);
  if (world_ > 1) registered_finish(kAg, others_, base + rounds, reads);
  if (pushes && *out_where) {  // for this rank's next guesses (guess_output)
    if (output_history_.size() >= 4096) output_history_.clear();
    OutputHistory& h = output_history_[*out_where];
    if (h.numbers.size() == kOutputHistory) h.numbers.erase(h.numbers.begin());
    h.numbers.push_back(base + 1);
    h.known.resize(world_, 0);
  }
}

uint64_t Protocol::guess_output(int peer, uint64_t number, uint64_t mine) {
  // The peer issued this call already: its word. Else the word it said the last time this
  // rank's output lay where it lies now (ranks allocate alike, so their buffers recur alike).
  // A rank whose host runs calls ahead of the peer's finds none of its latest calls published
  // yet: then the newest word it learnt from an earlier one.
  const uint64_t word = zero_copy_->published_output(peer, number);
  if (word || !mine) return word;
  auto it = output_history_.find(mine);
  if (it == output_history_.end()) return 0;
  OutputHistory& h = it->second;
  for (auto n = h.numbers.rbegin(); n != h.numbers.rend(); ++n) {
    if (const uint64_t w = zero_copy_->published_output(peer, *n)) return h.known[peer] = w;
  }
  return h.known[peer];
}

void Protocol::reduce_scatter_direct(void* out, const void* in, size_t out_numel, size_t elem_size,
                                     const ReduceSpec& spec, uint64_t where, uint64_t op_seq,
                                     uint64_t desc) {
  announce(desc);
  char* out_b = static_cast<char*>(out);
  const char* in_b = static_cast<const char*>(in);
  const size_t part = out_numel * elem_size;
  if (world_ == 1) {
    if (out_numel) t_->reduce(0, out, {in}, out_numel, spec);
    return;
  }
  const size_t round = layout_.chunk_bytes * layout_.slots;  // a multiple of 16: of every element
  const uint64_t rounds = direct_rounds(part);
  const uint64_t base = registered_count(kRs);
  registered_count(kRs) += rounds;
  const RegisteredId id{0, base + 1};
  const DescCheck check = registered_check(kRs, others_, id, desc);
  const WaitSite reads{"reduce_scatter", "the reads of this rank's input by", op_seq};
  std::vector<const uint64_t*> ready_here;
  for (int p : others_) ready_here.push_back(flag_in(rank_, words_of(kRs).ready, p));
  ReduceSpec from_peers = spec;
  from_peers.reads_peers = true;
  // This rank's part of every rank's input, in rank order: its own in place, the peers' where
  // they say (staged: the region of this rank's landing rings in their windows).
  std::vector<Located> srcs(world_);
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    srcs[p] = {flag_in(rank_, words_of(kRs).where, p), p, ring_at(p, layout_.rs_slot(rank_, 0)), 0};
  }
  // Each round on lane 0: this rank's input out (staged: once its readers are done with the
  // last round), then its part of everyone's reduced. A rank's staging waits only for rounds
  // its peers finished before they wait for its next one: no two ranks wait for each other.
  for (uint64_t r = 0; r < rounds; ++r) {
    const size_t off = r * round;
    const size_t len = std::min(round, part - std::min(off, part));
    direct_round(kRs, r, rounds, where, id, desc, reads, [&] {  // each reader's part, in its region
      for (int q : others_) {
        if (len) t_->copy(0, ring_at(rank_, layout_.rs_slot(q, 0)), in_b + q * part + off, len);
      }
    });
    t_->wait(0, ready_here, others_, base + r + 1, {"reduce_scatter", "the input of", op_seq},
             r == 0 && desc ? &check : nullptr);
    srcs[rank_].staged = in_b + rank_ * part + off;
    for (int p : others_) srcs[p].offset = rank_ * part + off;
    if (len) zero_copy_->reduce_located(0, out_b + off, srcs, len / elem_size, from_peers);
    registered_done(kRs, 0, others_, base + r + 1);
  }
  registered_finish(kRs, others_, base + rounds, reads);
}

}  // namespace odc
