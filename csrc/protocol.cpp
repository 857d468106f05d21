#include "protocol.hpp"

#include <algorithm>
#include <stdexcept>

namespace odc {

const char* dtype_name(DType d) {
  switch (d) {
    case DType::F32: return "float32";
    case DType::BF16: return "bfloat16";
    case DType::F16: return "float16";
  }
  return "?";
}

uint64_t op_desc(OpKind kind, int scalar_type, uint64_t bytes_per_rank, int red_op) {
  constexpr uint64_t kBytesMask = (uint64_t{1} << 48) - 1;  // 256 TiB per rank
  return (uint64_t{1} << 63) | (static_cast<uint64_t>(kind) & 7) << 60 |
         (static_cast<uint64_t>(red_op) & 15) << 56 |
         (static_cast<uint64_t>(scalar_type) & 255) << 48 | (bytes_per_rank & kBytesMask);
}

OpDescFields decode_op_desc(uint64_t desc) {
  return {static_cast<OpKind>((desc >> 60) & 7), static_cast<int>((desc >> 48) & 255),
          desc & ((uint64_t{1} << 48) - 1), static_cast<int>((desc >> 56) & 15)};
}

WindowLayout::WindowLayout(int world_, size_t chunk_bytes_, int slots_)
    : world(world_), chunk_bytes(chunk_bytes_), slots(slots_) {
  if (world <= 0 || slots <= 0 || chunk_bytes == 0 || chunk_bytes % 16 != 0) {
    throw std::invalid_argument(
        "odc: invalid window geometry (chunk bytes must be a positive multiple of 16, "
        "ring slots positive)");
  }
  flags_bytes = static_cast<size_t>(kNumFlagArrays) * world * kFlagStride;
  descs = flags_bytes;
  const size_t desc_end = descs + static_cast<size_t>(kNumDescArrays) * world * slots * 8;
  ag_ring = (desc_end + 4095) / 4096 * 4096;
  rs_ring = ag_ring + static_cast<size_t>(slots) * chunk_bytes;
  total = rs_ring + static_cast<size_t>(world) * slots * chunk_bytes;
}

Protocol::Protocol(int rank, int world, const WindowLayout& layout, Transport* transport)
    : rank_(rank), world_(world), layout_(layout), t_(transport) {}

uint64_t* Protocol::flag_in(int owner, WindowLayout::Flag kind, int index) {
  return reinterpret_cast<uint64_t*>(t_->window(owner) + layout_.flag(kind, index));
}

uint64_t* Protocol::desc_in(int owner, WindowLayout::Desc kind, int peer, uint64_t chunk) {
  return reinterpret_cast<uint64_t*>(t_->window(owner) + layout_.desc(kind, peer, chunk));
}

std::vector<const uint64_t*> Protocol::my_flags(WindowLayout::Flag kind, bool include_self) {
  std::vector<const uint64_t*> out;
  for (int p = 0; p < world_; ++p) {
    if (p != rank_ || include_self) out.push_back(flag_in(rank_, kind, p));
  }
  return out;
}

std::vector<int> Protocol::peers_but_me() const {
  std::vector<int> out;
  for (int p = 0; p < world_; ++p) if (p != rank_) out.push_back(p);
  return out;
}

// For chunk k: the owner publishes it into its AG ring (waiting only if a reader
// still holds the slot from `slots` chunks ago), then this rank gets chunk k of
// every peer on that peer's lane. Issuing publish(k) before get(k) in this order
// is deadlock-free even when executed sequentially by a host transport. With a
// descriptor, the owner stores it in each reader's window before announcing a chunk,
// and each reader checks it once the chunk is announced.
void Protocol::all_gather(void* out, const void* in, size_t shard_bytes, uint64_t op_seq,
                          uint64_t desc) {
  char* out_b = static_cast<char*>(out);
  const char* in_b = static_cast<const char*>(in);
  char* my_part = out_b + static_cast<size_t>(rank_) * shard_bytes;
  const bool copy_own = my_part != in_b && shard_bytes > 0;
  if (world_ == 1) {
    if (copy_own) t_->copy(0, my_part, in_b, shard_bytes);
    return;
  }

  const size_t C = layout_.chunk_bytes;
  // A checked empty all-gather still exchanges one empty chunk: a peer whose call is not
  // empty must see the mismatch rather than wait for a chunk that never comes.
  const uint64_t nchunks = std::max<uint64_t>((shard_bytes + C - 1) / C, desc ? 1 : 0);
  const auto readers = my_flags(WindowLayout::AgAck, false);
  const auto peers = peers_but_me();
  std::vector<uint64_t*> ready_at_readers;
  for (int p : peers) ready_at_readers.push_back(flag_in(p, WindowLayout::AgReady, rank_));

  for (uint64_t k = 0; k < nchunks; ++k) {
    const uint64_t g = ag_chunks_ + k;
    const size_t off = k * C;
    const size_t len = std::min(C, shard_bytes - off);
    if (g >= static_cast<uint64_t>(layout_.slots)) {
      t_->wait(0, readers, peers, g - layout_.slots + 1,
               {"all_gather", "ring space held by", op_seq});
    }
    if (len) t_->copy(0, t_->window(rank_) + layout_.ag_slot(g), in_b + off, len);
    if (desc) {
      std::vector<uint64_t*> desc_at_readers;
      for (int p : peers) desc_at_readers.push_back(desc_in(p, WindowLayout::AgDesc, rank_, g));
      t_->signal(0, desc_at_readers, desc);
    }
    t_->signal(0, ready_at_readers, g + 1);

    for (int i = 1; i < world_; ++i) {
      const int p = (rank_ + i) % world_;
      DescCheck check{{desc_in(rank_, WindowLayout::AgDesc, p, g)}, desc};
      t_->wait(i, {flag_in(rank_, WindowLayout::AgReady, p)}, {p}, g + 1,
               {"all_gather", "data from", op_seq}, desc ? &check : nullptr);
      if (len) {
        t_->copy(i, out_b + static_cast<size_t>(p) * shard_bytes + off,
                 t_->window(p) + layout_.ag_slot(g), len);
      }
      t_->signal(i, {flag_in(p, WindowLayout::AgAck, rank_)}, g + 1);
    }
  }
  ag_chunks_ += nchunks;
  // Our own part last: the peers' gets wait on the publishes above, not on this.
  if (copy_own) t_->copy(0, my_part, in_b, shard_bytes);
}

// For chunk k: put this rank's contribution for every owner into that owner's
// landing ring for us (waiting only if the owner has not yet consumed the slot
// from `slots` chunks ago), then reduce our own chunk once every contribution
// has landed, in rank order, and free the landing slots. With a descriptor, each
// sender stores it in the owner's window before announcing a chunk, and the owner
// checks every sender's before reducing.
void Protocol::reduce_scatter(void* out, const void* in, size_t out_numel, size_t elem_size,
                              const ReduceSpec& spec, uint64_t op_seq, uint64_t desc) {
  char* out_b = static_cast<char*>(out);
  const char* in_b = static_cast<const char*>(in);
  const size_t part_bytes = out_numel * elem_size;
  const size_t C = layout_.chunk_bytes;  // multiple of 16, so of every element size
  const uint64_t nchunks =  // an empty checked call too: see all_gather
      std::max<uint64_t>((part_bytes + C - 1) / C, desc && world_ > 1 ? 1 : 0);
  const auto peers = peers_but_me();
  const auto landed = my_flags(WindowLayout::RsReady, false);
  std::vector<uint64_t*> free_at_senders;
  for (int p : peers) free_at_senders.push_back(flag_in(p, WindowLayout::RsFree, rank_));

  for (uint64_t k = 0; k < nchunks; ++k) {
    const uint64_t g = rs_chunks_ + k;
    const size_t off = k * C;
    const size_t len = std::min(C, part_bytes - off);
    for (int i = 1; i < world_; ++i) {
      const int p = (rank_ + i) % world_;
      if (g >= static_cast<uint64_t>(layout_.slots)) {
        t_->wait(i, {flag_in(rank_, WindowLayout::RsFree, p)}, {p}, g - layout_.slots + 1,
                 {"reduce_scatter", "landing space at", op_seq});
      }
      if (len) {
        t_->copy(i, t_->window(p) + layout_.rs_slot(rank_, g),
                 in_b + static_cast<size_t>(p) * part_bytes + off, len);
      }
      if (desc) t_->signal(i, {desc_in(p, WindowLayout::RsDesc, rank_, g)}, desc);
      t_->signal(i, {flag_in(p, WindowLayout::RsReady, rank_)}, g + 1);
    }
    if (world_ > 1) {
      DescCheck check{{}, desc};
      for (int p : peers) check.descs.push_back(desc_in(rank_, WindowLayout::RsDesc, p, g));
      t_->wait(0, landed, peers, g + 1, {"reduce_scatter", "data from", op_seq},
               desc ? &check : nullptr);
    }
    std::vector<const void*> srcs;
    for (int src = 0; src < world_; ++src) {
      srcs.push_back(src == rank_ ? in_b + static_cast<size_t>(rank_) * part_bytes + off
                                  : t_->window(rank_) + layout_.rs_slot(src, g));
    }
    if (len) t_->reduce(0, out_b + off, srcs, len / elem_size, spec);
    if (world_ > 1) t_->signal(0, free_at_senders, g + 1);
  }
  rs_chunks_ += nchunks;
}

void Transport::unsupported(const char* what) {
  throw std::runtime_error(std::string("odc: ") + what + " is not available on this transport yet");
}

// ---- Decoupled mode

namespace {
size_t align64(size_t x) { return (x + 63) / 64 * 64; }
}  // namespace

ArenaLayout::ArenaLayout(int world_, const std::vector<size_t>& shard_numel,
                         const std::vector<size_t>& param_elem_size,
                         const std::vector<size_t>& grad_numel_)
    : world(world_), numel(shard_numel), grad_numel(grad_numel_) {
  size_t off = align64(static_cast<size_t>(kNumFlagArrays) * world * kFlagStride);
  for (size_t g = 0; g < numel.size(); ++g) {
    pub_bytes.push_back(numel[g] * param_elem_size[g]);
    pub_off.push_back(off);
    off = align64(off + pub_bytes.back());
    acc_off.push_back(off);
    off = align64(off + grad_numel[g] * sizeof(float));
  }
  total = off;
}

Arena::Arena(int rank, int world, ArenaLayout layout, Transport* transport, int id)
    : rank_(rank), world_(world), layout_(std::move(layout)), t_(transport), id_(id) {}

uint64_t* Arena::flag_in(int owner, ArenaLayout::Flag kind, int index) {
  return reinterpret_cast<uint64_t*>(base(owner) + layout_.flag(kind, index));
}

void Arena::publish(int group, const void* shard) {
  t_->copy(0, base(rank_) + layout_.pub_off[group], shard, layout_.pub_bytes[group]);
}

void Arena::announce(uint64_t epoch) {
  std::vector<uint64_t*> at_readers;
  for (int p = 0; p < world_; ++p) at_readers.push_back(flag_in(p, ArenaLayout::Pub, rank_));
  t_->signal(0, at_readers, epoch);
}

void Arena::get(int group, void* out, uint64_t epoch, uint64_t op_seq) {
  char* out_b = static_cast<char*>(out);
  const size_t bytes = layout_.pub_bytes[group];
  for (int i = 0; i < world_; ++i) {
    const int p = (rank_ + i) % world_;
    t_->wait(i, {flag_in(rank_, ArenaLayout::Pub, p)}, {p}, epoch,
             {"decoupled all_gather", "the published parameters of", op_seq});
    t_->copy(i, out_b + static_cast<size_t>(p) * bytes, base(p) + layout_.pub_off[group],
             bytes);
  }
}

void Arena::accumulate(int group, const void* in, DType dtype) {
  const size_t n = layout_.grad_numel[group];
  const size_t elem = dtype == DType::F32 ? 4 : 2;
  const char* in_b = static_cast<const char*>(in);
  for (int i = 0; i < world_; ++i) {
    const int p = (rank_ + i) % world_;
    t_->accumulate(i, reinterpret_cast<float*>(base(p) + layout_.acc_off[group]),
                   in_b + static_cast<size_t>(p) * n * elem, n, dtype);
  }
}

void Arena::finish(uint64_t epoch, uint64_t op_seq) {
  std::vector<uint64_t*> at_owners;
  std::vector<const uint64_t*> mine;
  std::vector<int> peers;
  for (int p = 0; p < world_; ++p) {
    at_owners.push_back(flag_in(p, ArenaLayout::Done, rank_));
    mine.push_back(flag_in(rank_, ArenaLayout::Done, p));
    peers.push_back(p);
  }
  t_->signal(0, at_owners, epoch);  // after every accumulate issued before it
  t_->wait(0, mine, peers, epoch, {"decoupled sync", "the gradient contributions of", op_seq});
}

void Arena::take(int group, float* out) {
  float* acc = reinterpret_cast<float*>(base(rank_) + layout_.acc_off[group]);
  const size_t bytes = layout_.grad_numel[group] * sizeof(float);
  t_->copy(0, out, acc, bytes);
  t_->fill_zero(0, acc, bytes);
}

}  // namespace odc
