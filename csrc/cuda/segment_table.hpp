// Layer 2, a transport's shared memory of the caller's (direct collectives, protocol.hpp): the
// allocator segments a rank's inputs lie in, mapped by its peers. Depends on the transport set-up
// (../rendezvous.hpp) and the kernels' view of a segment (kernels.cuh).
//
// Each rank has a table in host shared memory that every peer maps. The owner of an input looks
// up the allocation it lies in (cuPointerGetAttributes: its range and its buffer id, unique in
// the process) and, at first sight, writes the allocation's IPC handle under a slot and a new
// generation. Each peer, at its next operation, opens every new entry, writes the mapping where
// its kernels look (SegmentView, device memory) and then acknowledges (slot, generation) in
// its own table. The owner reads an input in place only once every peer acknowledged it; until
// then it stages it (Protocol::all_gather_direct), so no host ever waits for another.
// An entry ends when the caching allocator frees its segment (its trace hook, as
// ProcessGroupNCCL's registration hook) or when another allocation is found at its address (a
// new buffer id). The owner tells its peers only once the operations it had issued by then have
// completed (their events, issued()): the allocator's hook comes before cudaFree, while this
// rank's GPU may still run a collective that names the segment and whose readers, lagging,
// have not read it yet; an owner's collective completes only after every reader said it is
// done. Its peers close their mapping at their next operation after that: a mapping is never
// closed while read, never read once closed, and its slot is given again only then.
// Memory that cannot be shared this way (expandable segments, a pool of another allocator) is
// remembered and always staged.
// A pushed direct all-gather's output is shared the same way; its owner also publishes, as it
// issues the call, the output's Location word under the call's number (a ring in its table),
// so that a peer that issues later, or one that saw the same buffers before, can say on the
// host where to write, and write with the copy engines once the device confirmed the guess
// (guessed_puts.hpp).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "../rendezvous.hpp"
#include "kernels.cuh"

namespace odc {

class SegmentTable {
 public:
  SegmentTable(const TransportArgs& a, int device);  // collective (maps every rank's table)
  ~SegmentTable();
  SegmentTable(const SegmentTable&) = delete;
  SegmentTable& operator=(const SegmentTable&) = delete;

  // The owner: the Location word (layout.hpp) of `bytes` at `p` where every peer has its
  // segment mapped, else 0 (shared now if new; a later call finds it mapped).
  uint64_t locate(const void* p, size_t bytes);
  // Before each operation: tell the peers of segments whose end is due (above), map the
  // peers' new segments, close the ended ones, acknowledge.
  void refresh();
  // After each operation: the events of the last operation of each ring that reads inputs in
  // place (null: none yet); a segment freed from now on is told ended once they completed.
  void issued(std::vector<std::shared_ptr<void>> last_ops);
  // The owner's output word of its pushed all-gather `number` (publish), and a peer's as last
  // published under `number` (0: not yet, or no longer, known).
  void publish_output(uint64_t number, uint64_t word);
  uint64_t published_output(int owner, uint64_t number);
  // Where `bytes` at `offset` past the place `word` names in owner's memory lie in this
  // process (its mapping of the segment), or null where it has none of that generation or
  // they would pass the segment's end. Only while the owner's call that named it is in flight.
  char* mapping_of(int owner, uint64_t word, uint64_t offset, uint64_t bytes) const;
  // [world][kSegmentSlots], for the kernels (device memory: many blocks read it at once).
  const SegmentView* views() const { return views_; }
  // The caching allocator returned the segment at `base` of `device` to the driver.
  static void segment_freed(int device, uintptr_t base);

 private:
  struct Entry {  // in the owner's table
    std::atomic<uint64_t> word;  // generation << 1 | live (0: never used)
    uint64_t bytes;
    cudaIpcMemHandle_t handle;
  };
  struct Export {  // an allocation this rank shares
    int slot;  // -1: it cannot be shared
    uint64_t gen;
    unsigned long long buffer_id;
  };
  struct Ending {  // an export whose segment was freed, told to the peers once `after` completed
    int slot;
    uint64_t gen;
    std::vector<std::shared_ptr<void>> after;  // cudaEvent_t
  };
  struct Mapping {  // a peer's entry as this rank has it
    char* ptr = nullptr;
    uint64_t gen = 0;
    uint64_t bytes = 0;
    uint64_t failed = 0;  // the generation whose opening failed (not retried)
  };
  std::atomic<uint64_t>& version(int rank);  // bumped after every change of its entries
  Entry& entry(int rank, int slot);
  std::atomic<uint64_t>& acked(int reader, int owner, int slot);
  struct Published {  // an output word under its call's number (0 while being rewritten)
    std::atomic<uint64_t> number;
    std::atomic<uint64_t> word;
  };
  static constexpr int kPublished = 256;  // calls a peer's output words are kept for
  Published& published(int rank, uint64_t number);
  void end_export(uintptr_t base);  // mu_ held
  void tell_ended();                 // the due endings (mu_ held)
  void refresh_owner(int owner);
  // The kernels' view of a peer's slot, in place once this returns.
  void set_view(int owner, int slot, const SegmentView& v);

  TransportArgs a_;
  int device_;
  size_t entries_at_ = 0, acked_at_ = 0, published_at_ = 0, bytes_ = 0;  // the shared table's layout
  std::vector<char*> tables_;                          // every rank's, mapped here
  std::mutex mu_;  // the owner's state (the allocator's hook comes from any thread)
  std::unordered_map<uintptr_t, Export> exports_;
  std::vector<int> free_slots_;
  std::vector<Ending> ending_;                 // freed, not yet told
  std::vector<std::shared_ptr<void>> issued_;  // issued()
  std::vector<uint64_t> gens_;                 // per slot: its last generation
  std::vector<std::vector<Mapping>> mapped_;   // [owner][slot]
  std::vector<uint64_t> seen_;                 // per owner: the version last read
  SegmentView* views_ = nullptr;
  cudaStream_t copies_ = nullptr;  // set_view's
};

}  // namespace odc
