// Layer 3, protocol and arena: decoupled mode's arena, the one-sided state a decoupled
// model keeps between syncs (published shards, fp32 accumulators, epoch counters).
// Depends on the layout (layout.hpp) and the transport interface (transport.hpp).
#pragma once

#include <cstdint>
#include <vector>

#include "layout.hpp"
#include "transport.hpp"

namespace odc {

// Between two syncs: get() reads owners' published shards (waiting only until they
// announced the epoch), accumulate() adds into owners' accumulators (never waits).
// finish() is the minibatch's one synchronisation; take() then reads and clears this
// rank's accumulator; publish() + announce() make the next epoch's shards readable.
// Before finish, a rank done with a group for the epoch may say so (group_done(); finish
// with groups_too says it for every group), and take_when_done() takes this rank's
// accumulator of a group once every rank said so: its cross-replica reduction can start early.
// Group indices are validated by the caller (decoupled.cpp).
class Arena {
 public:
  // transport: its lanes; arenas: the same transport's arenas (`id` names this one).
  Arena(int rank, int world, ArenaLayout layout, Transport* transport, Arenas* arenas, int id);

  const ArenaLayout& layout() const { return layout_; }
  int id() const { return id_; }
  void publish(int group, const void* shard);
  void announce(uint64_t epoch);
  void get(int group, void* out, uint64_t epoch, uint64_t op_seq);  // out: world shards
  void accumulate(int group, const void* in, DType dtype);          // in: world shards
  void finish(uint64_t epoch, uint64_t op_seq, bool groups_too);
  void take(int group, float* out);
  void group_done(int group, uint64_t epoch);
  void take_when_done(int group, float* out, uint64_t epoch, uint64_t op_seq);

 private:
  uint64_t* flag_in(int owner, ArenaLayout::Flag kind, int index);
  uint64_t* group_flag_in(int owner, int group, int index);
  // This rank's GroupDone counters of `groups` at every owner.
  std::vector<uint64_t*> group_flags_at_owners(int first, int last);

  char* base(int rank) { return arenas_->arena(id_, rank); }

  int rank_;
  int world_;
  ArenaLayout layout_;
  Transport* t_;
  Arenas* arenas_;
  int id_;
};

}  // namespace odc
