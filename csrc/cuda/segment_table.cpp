// Layer 2, a transport's shared memory of the caller's (segment_table.hpp).
#include "segment_table.hpp"

#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "../transport_shm.hpp"
#include "device_memory.hpp"

namespace odc {
namespace {

using GetAttributesFn = CUresult (*)(unsigned, CUpointer_attribute*, void**, CUdeviceptr);

// cuPointerGetAttributes, looked up at run time (the extension links the runtime only).
GetAttributesFn get_attributes() {
  static GetAttributesFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuPointerGetAttributes", &f, 12000, cudaEnableDefault, &q) !=
            cudaSuccess || q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<GetAttributesFn>(nullptr);
    }
    return reinterpret_cast<GetAttributesFn>(f);
  }();
  return fn;
}

// Every table of this process, for the allocator's hook (attached once: it cannot be detached).
std::mutex g_tables_mu;
std::vector<SegmentTable*> g_tables;
std::once_flag g_hook_once;

void attach_allocator_hook() {
  std::call_once(g_hook_once, [] {
    try {
      using c10::cuda::CUDACachingAllocator::TraceEntry;
      c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker([](const TraceEntry& te) {
        if (te.action_ == TraceEntry::SEGMENT_FREE || te.action_ == TraceEntry::SEGMENT_UNMAP) {
          SegmentTable::segment_freed(te.device_, static_cast<uintptr_t>(te.addr_));
        }
      });
    } catch (const std::exception&) {
      // An allocator without trace hooks (cudaMallocAsync): ended segments are found by their
      // buffer ids alone, when their addresses are used again.
    }
  });
}

constexpr size_t kVersionBytes = 64;

}  // namespace

SegmentTable::SegmentTable(const TransportArgs& a, int device) : a_(a), device_(device) {
  entries_at_ = kVersionBytes;
  acked_at_ = entries_at_ + sizeof(Entry) * kSegmentSlots;
  published_at_ = acked_at_ + sizeof(uint64_t) * kSegmentSlots * static_cast<size_t>(a_.world);
  bytes_ = published_at_ + sizeof(Published) * kPublished;
  tables_ = map_host_segments(a_, "segments", bytes_);
  gens_.assign(kSegmentSlots, 0);
  for (int s = kSegmentSlots - 1; s >= 0; --s) free_slots_.push_back(s);
  mapped_.assign(a_.world, std::vector<Mapping>(kSegmentSlots));
  seen_.assign(a_.world, 0);
  // In device memory: a fused kernel's blocks all resolve their sources at once, and reads of
  // pinned host memory from so many blocks cost tens of microseconds (4 x H200).
  const size_t view_bytes = sizeof(SegmentView) * kSegmentSlots * static_cast<size_t>(a_.world);
  check(cudaMalloc(reinterpret_cast<void**>(&views_), view_bytes), "allocating the table of peers' segments");
  check(cudaMemset(views_, 0, view_bytes), "zeroing the table of peers' segments");
  check(cudaStreamCreateWithFlags(&copies_, cudaStreamNonBlocking), "creating a stream");
  attach_allocator_hook();
  std::lock_guard<std::mutex> lk(g_tables_mu);
  g_tables.push_back(this);
}

SegmentTable::~SegmentTable() {
  {
    std::lock_guard<std::mutex> lk(g_tables_mu);
    g_tables.erase(std::remove(g_tables.begin(), g_tables.end(), this), g_tables.end());
  }
  for (auto& owner : mapped_) {
    for (Mapping& m : owner) {
      if (m.ptr) (void)cudaIpcCloseMemHandle(m.ptr);
    }
  }
  if (copies_) (void)cudaStreamDestroy(copies_);
  if (views_) (void)cudaFree(views_);
  for (char* t : tables_) {
    if (t) munmap(t, bytes_);
  }
}

std::atomic<uint64_t>& SegmentTable::version(int rank) {
  return *reinterpret_cast<std::atomic<uint64_t>*>(tables_[rank]);
}

SegmentTable::Entry& SegmentTable::entry(int rank, int slot) {
  return reinterpret_cast<Entry*>(tables_[rank] + entries_at_)[slot];
}

std::atomic<uint64_t>& SegmentTable::acked(int reader, int owner, int slot) {
  auto* words = reinterpret_cast<std::atomic<uint64_t>*>(tables_[reader] + acked_at_);
  return words[static_cast<size_t>(owner) * kSegmentSlots + slot];
}

SegmentTable::Published& SegmentTable::published(int rank, uint64_t number) {
  return reinterpret_cast<Published*>(tables_[rank] + published_at_)[number % kPublished];
}

void SegmentTable::publish_output(uint64_t number, uint64_t word) {
  Published& p = published(a_.rank, number);
  p.number.store(0, std::memory_order_release);  // a reader between these sees no number
  p.word.store(word, std::memory_order_release);
  p.number.store(number, std::memory_order_release);
}

uint64_t SegmentTable::published_output(int owner, uint64_t number) {
  Published& p = published(owner, number);
  if (number == 0 || p.number.load(std::memory_order_acquire) != number) return 0;
  const uint64_t word = p.word.load(std::memory_order_acquire);
  return p.number.load(std::memory_order_acquire) == number ? word : 0;  // not rewritten meanwhile
}

char* SegmentTable::mapping_of(int owner, uint64_t word, uint64_t offset, uint64_t bytes) const {
  const Location loc = Location::decode(word);
  if (!loc.mapped || owner == a_.rank || loc.slot >= static_cast<uint32_t>(kSegmentSlots)) return nullptr;
  const Mapping& m = mapped_[owner][loc.slot];
  if (!m.ptr || (m.gen & Location::kGenMask) != loc.gen || loc.offset + offset + bytes > m.bytes) return nullptr;
  return m.ptr + loc.offset + offset;
}

uint64_t SegmentTable::locate(const void* p, size_t bytes) {
  GetAttributesFn attrs = get_attributes();
  if (!attrs || bytes == 0) return 0;
  CUdeviceptr start = 0;
  size_t size = 0;
  unsigned long long id = 0;
  CUpointer_attribute which[] = {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                 CU_POINTER_ATTRIBUTE_BUFFER_ID};
  void* out[] = {&start, &size, &id};
  if (attrs(3, which, out, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS) return 0;
  const uintptr_t base = static_cast<uintptr_t>(start);
  const uintptr_t at = reinterpret_cast<uintptr_t>(p);
  if (at < base || at + bytes > base + size || at - base > Location::kOffsetMask) return 0;
  std::lock_guard<std::mutex> lk(mu_);
  auto it = exports_.find(base);
  if (it != exports_.end() && it->second.buffer_id != id) {  // freed, and the address used again
    end_export(base);
    it = exports_.end();
  }
  if (it == exports_.end()) {
    Export e{-1, 0, id};
    cudaIpcMemHandle_t handle;
    if (!free_slots_.empty() && cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base)) == cudaSuccess) {
      e.slot = free_slots_.back();
      free_slots_.pop_back();
      e.gen = ++gens_[e.slot];
      Entry& en = entry(a_.rank, e.slot);
      en.bytes = size;
      en.handle = handle;
      en.word.store(e.gen << 1 | 1, std::memory_order_release);
      version(a_.rank).fetch_add(1, std::memory_order_release);
    } else {
      (void)cudaGetLastError();  // not shareable (or no slot left): staged
      if (free_slots_.empty()) return 0;  // not remembered: a slot may free up
    }
    exports_.emplace(base, e);
    return 0;  // the peers map it at their next operation
  }
  const Export& e = it->second;
  if (e.slot < 0) return 0;
  for (int r = 0; r < a_.world; ++r) {
    if (r != a_.rank && acked(r, a_.rank, e.slot).load(std::memory_order_acquire) != e.gen) return 0;
  }
  Location loc;
  loc.mapped = true;
  loc.slot = static_cast<uint32_t>(e.slot);
  loc.gen = e.gen;
  loc.offset = at - base;
  return loc.encode();
}

void SegmentTable::end_export(uintptr_t base) {
  auto it = exports_.find(base);
  if (it == exports_.end()) return;
  const Export e = it->second;
  exports_.erase(it);  // named by no later operation
  if (e.slot < 0) return;
  ending_.push_back(Ending{e.slot, e.gen, issued_});  // told once what was issued completed
}

void SegmentTable::tell_ended() {
  auto done = [](const std::shared_ptr<void>& ev) {
    if (!ev) return true;
    const cudaError_t r = cudaEventQuery(static_cast<cudaEvent_t>(ev.get()));
    if (r == cudaErrorNotReady) (void)cudaGetLastError();
    return r != cudaErrorNotReady;  // (an error elsewhere: the group fails on its own)
  };
  bool told = false;
  for (auto it = ending_.begin(); it != ending_.end();) {
    if (!std::all_of(it->after.begin(), it->after.end(), done)) {
      ++it;
      continue;
    }
    entry(a_.rank, it->slot).word.store(it->gen << 1, std::memory_order_release);  // ended
    free_slots_.push_back(it->slot);
    told = true;
    it = ending_.erase(it);
  }
  if (told) version(a_.rank).fetch_add(1, std::memory_order_release);
}

void SegmentTable::issued(std::vector<std::shared_ptr<void>> last_ops) {
  std::lock_guard<std::mutex> lk(mu_);
  issued_ = std::move(last_ops);
}

void SegmentTable::segment_freed(int device, uintptr_t base) {
  std::lock_guard<std::mutex> lk(g_tables_mu);
  for (SegmentTable* t : g_tables) {
    if (t->device_ != device) continue;
    std::lock_guard<std::mutex> tl(t->mu_);
    t->end_export(base);
  }
}

void SegmentTable::refresh() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    tell_ended();
  }
  for (int owner = 0; owner < a_.world; ++owner) {
    if (owner == a_.rank) continue;
    const uint64_t v = version(owner).load(std::memory_order_acquire);
    if (v == seen_[owner]) continue;
    seen_[owner] = v;
    refresh_owner(owner);
  }
}

void SegmentTable::refresh_owner(int owner) {
  for (int slot = 0; slot < kSegmentSlots; ++slot) {
    Entry& en = entry(owner, slot);
    const uint64_t word = en.word.load(std::memory_order_acquire);
    const bool live = word & 1;
    const uint64_t gen = word >> 1;
    Mapping& m = mapped_[owner][slot];
    if (live && (m.gen == gen || m.failed == gen)) continue;
    if (!live && !m.ptr) continue;
    if (m.ptr) {  // ended, or replaced by a newer generation
      acked(a_.rank, owner, slot).store(0, std::memory_order_release);
      set_view(owner, slot, SegmentView{nullptr, 0, 0});
      (void)cudaIpcCloseMemHandle(m.ptr);
      m = Mapping{};
    }
    if (!live) continue;
    const cudaIpcMemHandle_t handle = en.handle;
    const uint64_t bytes = en.bytes;
    if (en.word.load(std::memory_order_acquire) != word) {  // changed while read: next time
      seen_[owner] = 0;
      continue;
    }
    void* ptr = nullptr;
    if (cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
      (void)cudaGetLastError();
      m.failed = gen;  // never acknowledged: the owner keeps staging it
      continue;
    }
    m.ptr = static_cast<char*>(ptr);
    m.gen = gen;
    m.bytes = bytes;
    set_view(owner, slot, SegmentView{m.ptr, gen, bytes});  // before the acknowledgment: the
    acked(a_.rank, owner, slot).store(gen, std::memory_order_release);  // owner names it after
  }
}

void SegmentTable::set_view(int owner, int slot, const SegmentView& v) {
  SegmentView* at = views_ + static_cast<size_t>(owner) * kSegmentSlots + slot;
  check(cudaMemcpyAsync(at, &v, sizeof(v), cudaMemcpyHostToDevice, copies_), "updating a peer's segment");
  check(cudaStreamSynchronize(copies_), "updating a peer's segment");
}

}  // namespace odc
