// Layer 4, registered memory (pool.hpp).
#include "pool.hpp"

#include <algorithm>
#include <iterator>

namespace odc {

RegisteredPool::RegisteredPool(int rank, StreamOrder order) : rank_(rank), order_(std::move(order)) {}

void RegisteredPool::add_arena(std::vector<char*> bases, size_t bytes) {
  bytes = bytes / kAlign * kAlign;
  std::lock_guard<std::mutex> lk(mu_);
  if (bytes == 0) return;
  arenas_.push_back(Arena{end_, bytes, std::move(bases)});
  free_[end_] = Range{bytes, {}};
  end_ += bytes + kAlign;  // the gap: ranges of two arenas never touch, so never coalesce
  bytes_ += bytes;
}

size_t RegisteredPool::bytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  return bytes_;
}

size_t RegisteredPool::arenas() const {
  std::lock_guard<std::mutex> lk(mu_);
  return arenas_.size();
}

const RegisteredPool::Arena* RegisteredPool::arena_of(size_t offset) const {
  for (const Arena& a : arenas_) {
    if (offset >= a.start && offset < a.start + a.bytes) return &a;
  }
  return nullptr;
}

char* RegisteredPool::address(int rank, size_t offset) const {
  std::lock_guard<std::mutex> lk(mu_);
  const Arena* a = arena_of(offset);
  return a ? a->bases[rank] + (offset - a->start) : nullptr;
}

void RegisteredPool::prune(std::vector<Hazard>& hazards) {
  if (!order_.done) return;
  std::vector<Hazard> left;
  for (auto& h : hazards) {
    if (!order_.done(h.event)) left.push_back(std::move(h));
  }
  hazards.swap(left);
}

size_t RegisteredPool::allocate(size_t bytes) {
  const size_t need = footprint(bytes);
  std::lock_guard<std::mutex> lk(mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second.size < need) continue;
    const size_t off = it->first;
    Range r = std::move(it->second);
    free_.erase(it);
    prune(r.hazards);
    void* stream = order_.current ? order_.current() : nullptr;
    for (const Hazard& h : r.hazards) {
      if (h.stream != stream) order_.wait(stream, h.event);  // freed on another stream
    }
    if (r.size > need) free_[off + need] = Range{r.size - need, r.hazards};
    allocated_[off] = Block{need, bytes, stream};
    return off;
  }
  return SIZE_MAX;
}

void RegisteredPool::free(size_t offset) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = allocated_.find(offset);
  if (it == allocated_.end()) return;  // not ours (a tensor's deleter frees each block once)
  Range r{it->second.size, {}};
  if (order_.record) r.hazards.push_back(Hazard{it->second.stream, order_.record(it->second.stream)});
  allocated_.erase(it);
  // Coalesce with the free neighbours (their hazards come along).
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && next->first == offset + r.size) {
    r.size += next->second.size;
    for (auto& h : next->second.hazards) r.hazards.push_back(std::move(h));
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.size == offset) {
      prev->second.size += r.size;
      for (auto& h : r.hazards) prev->second.hazards.push_back(std::move(h));
      prune(prev->second.hazards);
      return;
    }
  }
  prune(r.hazards);
  free_[offset] = std::move(r);
}

bool RegisteredPool::is_block(const void* p, size_t bytes, size_t* offset) const {
  const char* c = static_cast<const char*>(p);
  std::lock_guard<std::mutex> lk(mu_);
  for (const Arena& a : arenas_) {
    const char* b = a.bases[rank_];
    if (!b || c < b || c >= b + a.bytes) continue;
    auto it = allocated_.find(a.start + static_cast<size_t>(c - b));
    if (it == allocated_.end() || it->second.requested != bytes) return false;
    *offset = it->first;
    return true;
  }
  return false;
}

}  // namespace odc
