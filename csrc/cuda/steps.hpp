// Layer 2, a transport: the CUDA transport's record of one operation (cuda_transport.hpp): the
// protocol's calls between begin_op and end_op as typed steps, their counters and sources in
// one list of words, run at end_op by the fused engine (fused_engine.hpp) or the copy engines
// (copy_engines.hpp). Depends on the transport interface and the kernels' types (kernels.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <variant>
#include <vector>

#include "../rendezvous.hpp"
#include "kernels.cuh"

namespace odc {

// Entries [first, first + n) of the recording's words (and their peers).
struct WordRange {
  int first = 0;
  int n = 0;
};

struct WaitStep {        // every counter >= target; then, if checked, the peers' descriptors
  WordRange counters;    // the descriptors follow them, at [first + n, first + 2n)
  uint64_t target = 0;
  bool checked = false;
  uint64_t desc = 0;     // DescCheck::expected
  uint64_t desc_id = 0;  // DescCheck::id
  WaitSite site{};
};
struct SignalStep {  // after the lane's earlier steps: each counter = value
  WordRange counters;
  uint64_t value = 0;
};
// A payload (Transport::store): stored as a signal is, but visible before the lane's next one.
struct StoreStep : SignalStep {};
struct CopyStep {
  void* dst;
  const void* src;
  size_t bytes;
};
struct ReduceStep {
  void* dst;
  WordRange srcs;
  size_t numel;
  ReduceSpec spec;
};
struct AccumulateStep {  // decoupled mode: dst += src, never fused
  float* dst;
  const void* src;
  size_t numel;
  DType dtype;
};
struct ZeroStep {
  void* dst;
  size_t bytes;
};
struct LocatedCopyStep {
  void* dst;
  Located src;
  size_t bytes;
  WaitSite site;  // the wait before it (its owner's "ready"), naming the operation in errors
};
// A push (ZeroCopyReads::push_located): src into where dst's owner says its buffer lies.
struct LocatedPushStep {
  Located dst;
  const void* src;
  size_t bytes;
  WaitSite site;       // the wait before it (the owner's "ready")
  uint64_t guess = 0;  // the word the owner is expected to say, and its place here (or null)
  char* guess_at = nullptr;
};
// srcs: the staged (or own) sources; their Location words follow, at first + n.
struct LocatedReduceStep : ReduceStep {
  uint64_t offset;  // past each located source's word's offset
  WaitSite site;
};

// In StepKind's order (kernels.cuh), so that a step's kind is its payload's index.
using StepPayload = std::variant<WaitStep, SignalStep, CopyStep, ReduceStep, AccumulateStep,
                                 ZeroStep, StoreStep, LocatedCopyStep, LocatedReduceStep,
                                 LocatedPushStep>;
static_assert(std::is_same_v<std::variant_alternative_t<kStepStore, StepPayload>, StoreStep> &&
                  std::is_same_v<std::variant_alternative_t<kStepReduceLocated, StepPayload>,
                                 LocatedReduceStep> &&
                  std::is_same_v<std::variant_alternative_t<kStepPushLocated, StepPayload>,
                                 LocatedPushStep>,
              "StepPayload follows StepKind");

struct Step {
  int lane;
  bool guarded;  // a step of a put_after: runs only if its wait succeeded
  StepPayload payload;

  StepKind kind() const { return static_cast<StepKind>(payload.index()); }
  template <typename T>
  const T* as() const { return std::get_if<T>(&payload); }
  bool is_data() const { return kind() != kStepWait && kind() != kStepSignal && kind() != kStepStore; }
  // A signal or a store (the counters or words it stores, and the value).
  const SignalStep* as_signal() const {
    return as<SignalStep>() ? as<SignalStep>() : static_cast<const SignalStep*>(as<StoreStep>());
  }
  // A reduction, of plain or located sources.
  const ReduceStep* as_reduction() const {
    return as<ReduceStep>() ? as<ReduceStep>() : static_cast<const ReduceStep*>(as<LocatedReduceStep>());
  }
  // The bytes its copy moves, or each source of its reduction holds (0: no such step).
  size_t data_bytes() const;
  // How many words of the recording it uses (counters, descriptors, sources, their words).
  int words() const;
};

class StepRecording {
 public:
  void clear();
  void wait(int lane, const std::vector<const uint64_t*>& flags, const std::vector<int>& peers,
            uint64_t target, const WaitSite& site, const DescCheck* check);
  void signal(int lane, const std::vector<uint64_t*>& flags, uint64_t value);
  void store(int lane, const std::vector<uint64_t*>& words, uint64_t value);
  void copy(int lane, void* dst, const void* src, size_t bytes);
  void reduce(int lane, void* dst, const std::vector<const void*>& srcs, size_t numel,
              const ReduceSpec& spec);
  void accumulate(int lane, float* dst, const void* src, size_t numel, DType dtype);
  void fill_zero(int lane, void* dst, size_t bytes);
  void copy_located(int lane, void* dst, const Located& src, size_t bytes);
  void push_located(int lane, const Located& dst, const void* src, size_t bytes, uint64_t guess,
                    char* guess_at);
  void reduce_located(int lane, void* dst, const std::vector<Located>& srcs, size_t numel,
                      const ReduceSpec& spec);
  // The steps recorded since `first` make one put (Transport::put_after).
  void guard_from(size_t first);
  // Every step on lane 0 (CopyEngines: an operation whose data moves on one lane).
  void merge_lanes();

  const std::vector<Step>& steps() const { return steps_; }
  bool empty() const { return steps_.empty(); }
  size_t size() const { return steps_.size(); }
  size_t word_count() const { return words_.size(); }
  const void* word(int i) const { return words_[i]; }
  uint64_t* counter(int i) const { return static_cast<uint64_t*>(const_cast<void*>(words_[i])); }
  int peer(int i) const { return peers_[i]; }

 private:
  WordRange add_words(const void* const* first, size_t n, const int* peers);
  void add(int lane, StepPayload payload);

  std::vector<Step> steps_;
  std::vector<const void*> words_;  // counters, descriptors, reduction sources, Location words
  std::vector<int> peers_;          // parallel to words_: a wait's peer per counter (else -1)
  WaitSite last_wait_{};            // the site of the last wait recorded
};

}  // namespace odc
