// Layer 4, registered memory (pool.hpp).
#include "pool.hpp"

#include <algorithm>
#include <iterator>

namespace odc {

RegisteredPool::RegisteredPool(std::vector<char*> bases, size_t bytes, int rank, StreamOrder order)
    : bases_(std::move(bases)), bytes_(bytes / kAlign * kAlign), rank_(rank), order_(std::move(order)) {
  if (bytes_) free_[0] = Range{bytes_, {}};
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
  const size_t need = std::max<size_t>((bytes + kAlign - 1) / kAlign * kAlign, kAlign);
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
  const char* b = bases_[rank_];
  if (!b || c < b || c >= b + bytes_) return false;
  std::lock_guard<std::mutex> lk(mu_);
  auto it = allocated_.find(static_cast<size_t>(c - b));
  if (it == allocated_.end() || it->second.requested != bytes) return false;
  *offset = it->first;
  return true;
}

}  // namespace odc
