// Layer 2, a transport: the CUDA transport's fused engine: a recorded operation (steps.hpp) whose
// copies and reductions are all small runs as one kernel, each lane on blocks of its own, so
// that the collective costs one launch instead of a dozen (kernels.cuh, FusedOp).
#pragma once

#include <vector>

#include "op_env.hpp"

namespace odc {

class FusedEngine {
 public:
  // small_op_bytes: the largest copy or reduction it runs (0: none); max_blocks: the most
  // blocks of one kernel.
  FusedEngine(int world, size_t small_op_bytes, int max_blocks);
  ~FusedEngine();
  FusedEngine(const FusedEngine&) = delete;
  FusedEngine& operator=(const FusedEngine&) = delete;

  // Whether `r` runs as one kernel (and then its blocks are planned for run()).
  bool plan(const StepRecording& r, bool any_routed);
  Transport::EngineUse run(const StepRecording& r, const OpEnv& env);

 private:
  bool fits(const Step& s) const;
  bool plan_blocks(const StepRecording& r);
  // The steps grouped by lane, in issue order, except that in a run of signals and stores the
  // stores go first: the run then costs one fence (Transport::signal / store's contract).
  std::vector<const Step*> lane_order(const StepRecording& r, FusedOp& op) const;
  void encode(const Step& s, FusedStep& f, FusedOp& op) const;

  int world_;
  size_t small_op_bytes_;
  int max_blocks_;
  std::vector<int> plan_;         // blocks per lane of the planned operation
  unsigned* arrivals_ = nullptr;  // kFusedArrivalsPerOp counters per ring (FusedOp::arrivals)
};

}  // namespace odc
