// Layer 3, protocol and arena: decoupled mode's arena (arena.hpp).
#include "arena.hpp"

#include <algorithm>
#include <stdexcept>

namespace odc {

Arena::Arena(int rank, int world, ArenaLayout layout, Transport* transport, Arenas* arenas,
             int id)
    : rank_(rank), world_(world), layout_(std::move(layout)), t_(transport), arenas_(arenas),
      id_(id) {}

uint64_t* Arena::flag_in(int owner, ArenaLayout::Flag kind, int index) {
  return reinterpret_cast<uint64_t*>(base(owner) + layout_.flag(kind, index));
}

uint64_t* Arena::group_flag_in(int owner, int group, int index) {
  return reinterpret_cast<uint64_t*>(base(owner) + layout_.group_done(group, index));
}

std::vector<uint64_t*> Arena::group_flags_at_owners(int first, int last) {
  std::vector<uint64_t*> at_owners;
  for (int g = first; g < last; ++g) {
    for (int p = 0; p < world_; ++p) at_owners.push_back(group_flag_in(p, g, rank_));
  }
  return at_owners;
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
    arenas_->accumulate(i, reinterpret_cast<float*>(base(p) + layout_.acc_off[group]),
                   in_b + static_cast<size_t>(p) * n * elem, n, dtype);
  }
}

void Arena::finish(uint64_t epoch, uint64_t op_seq, bool groups_too) {
  std::vector<uint64_t*> at_owners;
  std::vector<const uint64_t*> mine;
  std::vector<int> peers;
  for (int p = 0; p < world_; ++p) {
    at_owners.push_back(flag_in(p, ArenaLayout::Done, rank_));
    mine.push_back(flag_in(rank_, ArenaLayout::Done, p));
    peers.push_back(p);
  }
  // after every accumulate issued before it; first the groups' counters, which early takes
  // of groups this rank did not say it was done with wait for
  if (groups_too) t_->signal(0, group_flags_at_owners(0, static_cast<int>(layout_.numel.size())), epoch);
  t_->signal(0, at_owners, epoch);
  t_->wait(0, mine, peers, epoch, {"decoupled sync", "the gradient contributions of", op_seq});
}

void Arena::group_done(int group, uint64_t epoch) {
  t_->signal(0, group_flags_at_owners(group, group + 1), epoch);  // after its accumulates
}

void Arena::take_when_done(int group, float* out, uint64_t epoch, uint64_t op_seq) {
  std::vector<const uint64_t*> mine;
  std::vector<int> peers;
  for (int p = 0; p < world_; ++p) {
    mine.push_back(group_flag_in(rank_, group, p));
    peers.push_back(p);
  }
  t_->wait(0, mine, peers, epoch, {"decoupled early reduction", "the gradient contributions of", op_seq});
  take(group, out);
}

void Arena::take(int group, float* out) {
  float* acc = reinterpret_cast<float*>(base(rank_) + layout_.acc_off[group]);
  const size_t bytes = layout_.grad_numel[group] * sizeof(float);
  t_->copy(0, out, acc, bytes);
  arenas_->fill_zero(0, acc, bytes);
}

}  // namespace odc
