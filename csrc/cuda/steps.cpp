// Layer 2, a transport: the CUDA transport's record of one operation (steps.hpp).
#include "steps.hpp"

#include <algorithm>

namespace odc {

size_t Step::data_bytes() const {
  if (auto* c = as<CopyStep>()) return c->bytes;
  if (auto* c = as<LocatedCopyStep>()) return c->bytes;
  if (auto* c = as<LocatedPushStep>()) return c->bytes;
  if (auto* r = as_reduction()) return r->numel * dtype_size(r->spec.dtype);
  return 0;
}

int Step::words() const {
  if (auto* w = as<WaitStep>()) return (w->checked ? 2 : 1) * w->counters.n;
  if (auto* s = as_signal()) return s->counters.n;
  if (auto* r = as_reduction()) return (as<LocatedReduceStep>() ? 2 : 1) * r->srcs.n;
  return 0;
}

void StepRecording::clear() {
  steps_.clear();
  words_.clear();
  peers_.clear();
  last_wait_ = WaitSite{};
}

WordRange StepRecording::add_words(const void* const* first, size_t n, const int* peers) {
  const WordRange r{static_cast<int>(words_.size()), static_cast<int>(n)};
  words_.insert(words_.end(), first, first + n);
  if (peers) {
    peers_.insert(peers_.end(), peers, peers + n);
  } else {
    peers_.resize(words_.size(), -1);
  }
  return r;
}

void StepRecording::add(int lane, StepPayload payload) {
  steps_.push_back(Step{lane, false, std::move(payload)});
}

void StepRecording::wait(int lane, const std::vector<const uint64_t*>& flags,
                         const std::vector<int>& peers, uint64_t target, const WaitSite& site,
                         const DescCheck* check) {
  WaitStep w;
  w.counters = add_words(reinterpret_cast<const void* const*>(flags.data()), flags.size(),
                         peers.data());
  if (check) {  // the descriptors follow the counters, with the same peers
    add_words(reinterpret_cast<const void* const*>(check->descs.data()), check->descs.size(),
              peers.data());
    w.checked = true;
    w.desc = check->expected;
    w.desc_id = check->id;
  }
  w.target = target;
  w.site = site;
  last_wait_ = site;
  add(lane, w);
}

void StepRecording::signal(int lane, const std::vector<uint64_t*>& flags, uint64_t value) {
  add(lane, SignalStep{add_words(reinterpret_cast<const void* const*>(flags.data()), flags.size(),
                                 nullptr),
                       value});
}

void StepRecording::store(int lane, const std::vector<uint64_t*>& words, uint64_t value) {
  add(lane, StoreStep{{add_words(reinterpret_cast<const void* const*>(words.data()), words.size(),
                                 nullptr),
                       value}});
}

void StepRecording::copy(int lane, void* dst, const void* src, size_t bytes) {
  add(lane, CopyStep{dst, src, bytes});
}

void StepRecording::reduce(int lane, void* dst, const std::vector<const void*>& srcs,
                           size_t numel, const ReduceSpec& spec) {
  add(lane, ReduceStep{dst, add_words(srcs.data(), srcs.size(), nullptr), numel, spec});
}

void StepRecording::accumulate(int lane, float* dst, const void* src, size_t numel, DType dtype) {
  add(lane, AccumulateStep{dst, src, numel, dtype});
}

void StepRecording::fill_zero(int lane, void* dst, size_t bytes) {
  add(lane, ZeroStep{dst, bytes});
}

void StepRecording::copy_located(int lane, void* dst, const Located& src, size_t bytes) {
  add(lane, LocatedCopyStep{dst, src, bytes, last_wait_});
}

void StepRecording::push_located(int lane, const Located& dst, const void* src, size_t bytes,
                                 uint64_t guess, char* guess_at) {
  add(lane, LocatedPushStep{dst, src, bytes, last_wait_, guess, guess_at});
}

void StepRecording::reduce_located(int lane, void* dst, const std::vector<Located>& srcs,
                                   size_t numel, const ReduceSpec& spec) {
  std::vector<const void*> words;
  uint64_t offset = 0;  // one offset for every located source
  for (const Located& l : srcs) {
    words.push_back(l.staged);
    if (l.where) offset = l.offset;
  }
  for (const Located& l : srcs) words.push_back(l.where);
  WordRange r = add_words(words.data(), words.size(), nullptr);
  r.n = static_cast<int>(srcs.size());
  add(lane, LocatedReduceStep{{dst, r, numel, spec}, offset, last_wait_});
}

void StepRecording::guard_from(size_t first) {
  for (size_t i = first; i < steps_.size(); ++i) steps_[i].guarded = true;
}

void StepRecording::merge_lanes() {
  for (Step& s : steps_) s.lane = 0;
}

}  // namespace odc
