// Layer 4, registered memory: the pool behind the backend's allocate_tensor. Depends on
// nothing of odc's: the backend grows it by the transport's arenas (Arenas, transport.hpp),
// mapped by every peer, and hands it their bases.
// It starts empty and grows by an arena when an allocation finds no room, up to
// ODC_POOL_BYTES: every rank grows at the same allocation, since the pools evolve alike.
//
// A collective whose input lies in registered memory runs zero-copy (Protocol::
// *_registered): its peers read the input where it lies, so nothing is staged through the
// window's rings. They find it at the same place of the owner's pool as their own: the pool
// hands out the same offsets on every rank as long as the ranks allocate and free the same
// sizes in the same order (what FSDP2 does), and the collectives check that they did.
//
// Offsets depend on that order alone, never on timing. Reuse is safe on the GPU because a
// registered collective completes only once its peers are done reading, and memory freed
// on one stream is reused on another only after the work queued on the first at the free
// (StreamOrder: the caching allocator's rule, which FSDP2 relies on).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace odc {

class RegisteredPool {
 public:
  // How allocations are ordered on streams (CUDA; empty functions: the CPU, nothing to order).
  struct StreamOrder {
    std::function<void*()> current;                               // the allocating stream
    std::function<std::shared_ptr<void>(void* stream)> record;    // an event of the stream now
    std::function<bool(const std::shared_ptr<void>& event)> done;  // has it completed?
    std::function<void(void* stream, const std::shared_ptr<void>& event)> wait;
  };
  static constexpr size_t kAlign = 256;
  // What a block of `bytes` takes from the pool.
  static size_t footprint(size_t bytes) {
    return std::max<size_t>((bytes + kAlign - 1) / kAlign * kAlign, kAlign);
  }

  explicit RegisteredPool(int rank, StreamOrder order = {});

  // Adds an arena of `bytes` (every rank's, mapped here: bases[r] is rank r's) to the pool.
  // Offsets are the pool's own: each arena takes the next range of them, with a gap after
  // it, so that no block or free range ever spans two arenas.
  void add_arena(std::vector<char*> bases, size_t bytes);
  size_t bytes() const;   // of all the arenas
  size_t arenas() const;  // how many

  // The offset of a new block of `bytes` (the lowest that fits), or SIZE_MAX when none does.
  size_t allocate(size_t bytes);
  void free(size_t offset);

  // Where rank r's pool has `offset` (an offset of a block), mapped here.
  char* address(int rank, size_t offset) const;
  // Whether p is the start of a live block of exactly `bytes` (as allocated); its offset.
  bool is_block(const void* p, size_t bytes, size_t* offset) const;

 private:
  struct Hazard {  // work queued on `stream` when part of a range was freed
    void* stream;
    std::shared_ptr<void> event;
  };
  struct Range {
    size_t size;
    std::vector<Hazard> hazards;
  };
  struct Block {
    size_t size;       // taken from the pool (aligned)
    size_t requested;  // asked for
    void* stream;
  };
  void prune(std::vector<Hazard>& hazards);

  struct Arena {
    size_t start;              // its first offset
    size_t bytes;
    std::vector<char*> bases;  // every rank's
  };
  const Arena* arena_of(size_t offset) const;  // under mu_

  std::vector<Arena> arenas_;  // by start
  size_t end_ = 0;             // the next arena's start
  size_t bytes_ = 0;
  int rank_;
  StreamOrder order_;
  mutable std::mutex mu_;               // tensors are freed on any thread
  std::map<size_t, Range> free_;        // by offset, coalesced
  std::map<size_t, Block> allocated_;   // by offset
};

}  // namespace odc
