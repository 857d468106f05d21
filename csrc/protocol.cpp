// Layer 3, protocol and arena: the one-sided protocol (protocol.hpp).
#include "protocol.hpp"

#include <algorithm>
#include <stdexcept>

namespace odc {

Protocol::Protocol(int rank, int world, const WindowLayout& layout, Transport* transport,
                   ZeroCopyReads* zero_copy)
    : rank_(rank),
      world_(world),
      layout_(layout),
      t_(transport),
      zero_copy_(zero_copy),
      ag_pub_(world, 0),
      rs_sent_(world, 0),
      rs_landed_(world, 0) {
  for (int p = 0; p < world; ++p) {
    if (p != rank) others_.push_back(p);
    only_.push_back({p});
  }
}

uint64_t* Protocol::flag_in(int owner, WindowLayout::Flag kind, int index) {
  return reinterpret_cast<uint64_t*>(t_->window(owner) + layout_.flag(kind, index));
}

uint64_t* Protocol::desc_in(int owner, WindowLayout::Desc kind, int peer, uint64_t chunk) {
  return reinterpret_cast<uint64_t*>(t_->window(owner) + layout_.desc(kind, peer, chunk));
}

void Protocol::store_desc(int lane, const std::vector<uint64_t*>& at, uint64_t desc, uint64_t g) {
  std::vector<uint64_t*> ids;
  for (uint64_t* d : at) ids.push_back(d + 1);
  t_->store(lane, at, desc);  // payloads: visible before the counter signalled after them
  t_->store(lane, ids, g);
}

void Protocol::begin_collective() {
  ++collectives_;
  unannounced_ = true;
}

void Protocol::end_collective(bool failed) {
  if (failed && unannounced_) --collectives_;
  unannounced_ = false;
  t_->watch(PeerWatch{});
}

void Protocol::announce(uint64_t desc) {
  if (!unannounced_) return;
  unannounced_ = false;
  if (desc == 0 || world_ == 1) return;
  const uint64_t word = announce_word(desc, collectives_);
  std::vector<uint64_t*> at;
  for (int p : others_) {
    at.push_back(reinterpret_cast<uint64_t*>(t_->window(p) + layout_.announce_slot(rank_, collectives_)));
  }
  t_->signal(0, at, word);
  t_->watch(PeerWatch{reinterpret_cast<const uint64_t*>(t_->window(rank_) + layout_.announce), word});
}

// A checked empty call still moves one empty chunk: a peer whose call is not empty
// must see the mismatch rather than wait for a chunk that never comes.
uint64_t Protocol::chunks(size_t bytes, bool at_least_one) const {
  const size_t C = layout_.chunk_bytes;
  return std::max<uint64_t>((bytes + C - 1) / C, at_least_one ? 1 : 0);
}

// For chunk k: the owner publishes it into its AG ring (waiting only if a reader
// still holds the slot from `slots` chunks ago), then this rank gets chunk k of
// every peer on that peer's lane. With a descriptor, the owner stores it in each
// reader's window before announcing a chunk, and each reader checks it once the
// chunk is announced.
void Protocol::all_gather(void* out, const void* in, size_t shard_bytes, uint64_t op_seq,
                          uint64_t desc) {
  char* out_b = static_cast<char*>(out);
  const char* in_b = static_cast<const char*>(in);
  char* my_part = out_b + static_cast<size_t>(rank_) * shard_bytes;
  const bool copy_own = my_part != in_b && shard_bytes > 0;
  announce(desc);
  if (world_ == 1) {
    if (copy_own) t_->copy(0, my_part, in_b, shard_bytes);
    return;
  }
  const size_t C = layout_.chunk_bytes;
  const uint64_t nchunks = chunks(shard_bytes, desc != 0);
  const std::vector<int>& peers = others_;
  std::vector<const uint64_t*> acks;
  std::vector<uint64_t*> ready_at_readers;
  for (int p : peers) {
    acks.push_back(flag_in(rank_, WindowLayout::AgAck, p));
    ready_at_readers.push_back(flag_in(p, WindowLayout::AgReady, rank_));
  }
  for (uint64_t k = 0; k < nchunks; ++k) {
    const size_t off = k * C;
    const size_t len = std::min(C, shard_bytes - std::min(off, shard_bytes));
    const uint64_t g = ag_pub_[rank_] + k;
    if (g >= static_cast<uint64_t>(layout_.slots)) {
      t_->wait(0, acks, peers, g - layout_.slots + 1, {"all_gather", "ring space held by", op_seq});
    }
    if (len) t_->copy(0, ring_at(rank_, layout_.ag_slot(g)), in_b + off, len);
    if (desc) {
      std::vector<uint64_t*> desc_at_readers;
      for (int p : peers) desc_at_readers.push_back(desc_in(p, WindowLayout::AgDesc, rank_, g));
      store_desc(0, desc_at_readers, desc, g);
    }
    t_->signal(0, ready_at_readers, g + 1);

    for (int i = 1; i < world_; ++i) {
      const int p = (rank_ + i) % world_;
      const uint64_t gp = ag_pub_[p] + k;
      DescCheck check{{desc_in(rank_, WindowLayout::AgDesc, p, gp)}, desc, gp};
      t_->wait(i, {flag_in(rank_, WindowLayout::AgReady, p)}, only_[p], gp + 1,
               {"all_gather", "data from", op_seq}, desc ? &check : nullptr);
      if (len) {
        t_->copy(i, out_b + static_cast<size_t>(p) * shard_bytes + off,
                 ring_at(p, layout_.ag_slot(gp)), len);
      }
      t_->signal(i, {flag_in(p, WindowLayout::AgAck, rank_)}, gp + 1);
    }
  }
  for (uint64_t& n : ag_pub_) n += nchunks;
  // Our own part last: the peers' gets wait on the publishes above, not on this.
  if (copy_own) t_->copy(0, my_part, in_b, shard_bytes);
}

// The all-gather with one owner: the root publishes, the others get.
void Protocol::broadcast(void* buf, size_t bytes, int root, uint64_t op_seq, uint64_t desc) {
  announce(desc);
  if (world_ == 1) return;
  char* b = static_cast<char*>(buf);
  const size_t C = layout_.chunk_bytes;
  const uint64_t nchunks = chunks(bytes, desc != 0);
  std::vector<int> readers;
  std::vector<const uint64_t*> acks;
  std::vector<uint64_t*> ready_at_readers, desc_at_readers;
  for (int p = 0; p < world_; ++p) {
    if (p == root) continue;
    readers.push_back(p);
    acks.push_back(flag_in(root, WindowLayout::AgAck, p));
    ready_at_readers.push_back(flag_in(p, WindowLayout::AgReady, root));
  }
  const int lane = (root - rank_ + world_) % world_;  // the root's lane on a reader
  for (uint64_t k = 0; k < nchunks; ++k) {
    const size_t off = k * C;
    const size_t len = std::min(C, bytes - std::min(off, bytes));
    const uint64_t g = ag_pub_[root] + k;
    char* slot = ring_at(root, layout_.ag_slot(g));
    if (rank_ == root) {
      if (g >= static_cast<uint64_t>(layout_.slots)) {
        t_->wait(0, acks, readers, g - layout_.slots + 1,
                 {"broadcast", "ring space held by", op_seq});
      }
      if (len) t_->copy(0, slot, b + off, len);
      if (desc) {
        desc_at_readers.clear();
        for (int p : readers) desc_at_readers.push_back(desc_in(p, WindowLayout::AgDesc, root, g));
        store_desc(0, desc_at_readers, desc, g);
      }
      t_->signal(0, ready_at_readers, g + 1);
    } else {
      DescCheck check{{desc_in(rank_, WindowLayout::AgDesc, root, g)}, desc, g};
      t_->wait(lane, {flag_in(rank_, WindowLayout::AgReady, root)}, {root}, g + 1,
               {"broadcast", "data from", op_seq}, desc ? &check : nullptr);
      if (len) t_->copy(lane, b + off, slot, len);
      t_->signal(lane, {flag_in(root, WindowLayout::AgAck, rank_)}, g + 1);
    }
  }
  ag_pub_[root] += nchunks;
}

void Protocol::put_chunk(int lane, int p, uint64_t g, const char* src, size_t len,
                         uint64_t desc, const char* op, uint64_t op_seq) {
  if (g >= static_cast<uint64_t>(layout_.slots)) {
    t_->wait(lane, {flag_in(rank_, WindowLayout::RsFree, p)}, only_[p], g - layout_.slots + 1,
             {op, "landing space at", op_seq});
  }
  if (len) t_->copy(lane, ring_at(p, layout_.rs_slot(rank_, g)), src, len);
  if (desc) store_desc(lane, {desc_in(p, WindowLayout::RsDesc, rank_, g)}, desc, g);
  t_->signal(lane, {flag_in(p, WindowLayout::RsReady, rank_)}, g + 1);
}

// For chunk k: put this rank's contribution for every owner into that owner's
// landing ring for us (waiting only if the owner has not yet consumed the slot
// from `slots` chunks ago), then reduce our own chunk once every contribution
// has landed, in rank order, and free the landing slots. With a descriptor, each
// sender stores it in the owner's window before announcing a chunk, and the owner
// checks every sender's before reducing.
void Protocol::reduce_scatter(void* out, const void* in, size_t out_numel, size_t elem_size,
                              const ReduceSpec& spec, uint64_t op_seq, uint64_t desc) {
  announce(desc);
  char* out_b = static_cast<char*>(out);
  const char* in_b = static_cast<const char*>(in);
  const size_t part_bytes = out_numel * elem_size;
  const size_t C = layout_.chunk_bytes;  // multiple of 16, so of every element size
  const uint64_t nchunks = chunks(part_bytes, desc != 0 && world_ > 1);
  const std::vector<int>& peers = others_;
  std::vector<uint64_t*> free_at_senders;
  for (int p : peers) free_at_senders.push_back(flag_in(p, WindowLayout::RsFree, rank_));

  for (uint64_t k = 0; k < nchunks; ++k) {
    const size_t off = k * C;
    const size_t len = std::min(C, part_bytes - std::min(off, part_bytes));
    for (int i = 1; i < world_; ++i) {
      const int p = (rank_ + i) % world_;
      put_chunk(i, p, rs_sent_[p] + k, in_b + static_cast<size_t>(p) * part_bytes + off, len,
                desc, "reduce_scatter", op_seq);
    }
    // Every sender's chunk k; senders whose counters agree (all of them, unless an
    // uneven exchange came before) share one wait.
    for (size_t first = 0; first < peers.size();) {
      const uint64_t target = rs_landed_[peers[first]] + k + 1;
      std::vector<int> group;
      std::vector<const uint64_t*> landed;
      DescCheck check{{}, desc, target - 1};
      for (size_t j = first; j < peers.size() && rs_landed_[peers[j]] + k + 1 == target; ++j) {
        group.push_back(peers[j]);
        landed.push_back(flag_in(rank_, WindowLayout::RsReady, peers[j]));
        check.descs.push_back(desc_in(rank_, WindowLayout::RsDesc, peers[j], target - 1));
      }
      t_->wait(0, landed, group, target, {"reduce_scatter", "data from", op_seq},
               desc ? &check : nullptr);
      first += group.size();
    }
    std::vector<const void*> srcs;
    for (int src = 0; src < world_; ++src) {
      srcs.push_back(src == rank_ ? in_b + static_cast<size_t>(rank_) * part_bytes + off
                                  : ring_at(rank_, layout_.rs_slot(src, rs_landed_[src] + k)));
    }
    if (len) t_->reduce(0, out_b + off, srcs, len / elem_size, spec);
    for (size_t first = 0; first < peers.size();) {  // one signal per run of equal counters
      const uint64_t v = rs_landed_[peers[first]] + k + 1;
      std::vector<uint64_t*> same;
      size_t j = first;
      for (; j < peers.size() && rs_landed_[peers[j]] + k + 1 == v; ++j) {
        same.push_back(free_at_senders[j]);
      }
      t_->signal(0, same, v);
      first = j;
    }
  }
  for (int p : peers) {
    rs_sent_[p] += nchunks;
    rs_landed_[p] += nchunks;
  }
}

// Chunk-major, like reduce_scatter: chunk k to every peer, then chunk k from every peer,
// each pair on the peer's lane.
void Protocol::exchange(void* out, const void* in, const Exchange& x, uint64_t op_seq) {
  char* out_b = static_cast<char*>(out);
  const char* in_b = static_cast<const char*>(in);
  const size_t C = layout_.chunk_bytes;
  const char* op = kind_name(x.kind);
  announce(x.check ? op_desc(x.kind, x.scalar_type, 0, 0, x.root) : 0);
  std::vector<uint64_t> n_send(world_, 0), n_recv(world_, 0);
  uint64_t rounds = 0;
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    n_send[p] = chunks(x.send[p], x.check && x.talk_empty);
    n_recv[p] = chunks(x.recv[p], x.check && x.talk_empty);
    rounds = std::max({rounds, n_send[p], n_recv[p]});
  }
  auto desc_of = [&](size_t bytes) {
    return x.check ? op_desc(x.kind, x.scalar_type, bytes, 0, x.root) : 0;
  };
  for (uint64_t k = 0; k < rounds; ++k) {
    for (int i = 1; i < world_; ++i) {
      const int p = (rank_ + i) % world_;
      if (k >= n_send[p]) continue;
      const size_t off = k * C;
      put_chunk(i, p, rs_sent_[p] + k, in_b + x.send_off[p] + off,
                std::min(C, x.send[p] - std::min(off, x.send[p])), desc_of(x.send[p]), op, op_seq);
    }
    for (int i = 1; i < world_; ++i) {
      const int p = (rank_ + i) % world_;
      if (k >= n_recv[p]) continue;
      const uint64_t g = rs_landed_[p] + k;
      const size_t off = k * C;
      const size_t len = std::min(C, x.recv[p] - std::min(off, x.recv[p]));
      const uint64_t desc = desc_of(x.recv[p]);
      DescCheck check{{desc_in(rank_, WindowLayout::RsDesc, p, g)}, desc, g};
      t_->wait(i, {flag_in(rank_, WindowLayout::RsReady, p)}, only_[p], g + 1, {op, "data from", op_seq},
               desc ? &check : nullptr);
      if (len) t_->copy(i, out_b + x.recv_off[p] + off, ring_at(rank_, layout_.rs_slot(p, g)), len);
      t_->signal(i, {flag_in(p, WindowLayout::RsFree, rank_)}, g + 1);
    }
  }
  for (int p = 0; p < world_; ++p) {
    rs_sent_[p] += n_send[p];
    rs_landed_[p] += n_recv[p];
  }
  const size_t own = std::min(x.send[rank_], x.recv[rank_]);
  if (own) t_->copy(0, out_b + x.recv_off[rank_], in_b + x.send_off[rank_], own);
}

}  // namespace odc
