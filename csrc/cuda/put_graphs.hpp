// Layer 2, a transport: the CUDA transport's puts on the copy engines (Transport::put_after):
// writes into a peer's memory that only a successful wait lets through. A queued copy cannot be
// cancelled, so they run as a CUDA graph per set of puts, made at its first use and kept (FSDP's
// buffers recur every step): a gate kernel waits for every peer's counter and checks its
// descriptor, then a conditional node, which runs only when the gate set its condition, holds
// the copies and the signals (each a copy of the gate's `go` word to the peer's counter), one
// after another on the operation's stream. Measured on 4 GPUs: one gate per operation beat one
// per put (64 MiB: 180-184 against 210-213 us), and writes one after another beat a stream per
// peer (docs/performance.md). The fused kernel runs puts as any other steps.
#pragma once

#include <vector>

#include "graph_cache.hpp"
#include "op_env.hpp"

namespace odc {

class PutGraphs {
 public:
  struct Graph {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    std::vector<cudaGraphNode_t> gates;
    std::vector<cudaGraphConditionalHandle> conds;
    uint64_t* go = nullptr;      // one word per put
    cudaEvent_t last = nullptr;  // recorded after its last launch
  };
  struct Set {  // the puts behind one gate (all of an operation's, up to kMaxGatePeers)
    std::vector<const WaitStep*> waits;
    std::vector<const CopyStep*> copies;  // null: nothing to copy
    std::vector<const SignalStep*> signals;
  };
  struct Run {  // a run of guarded steps of the operation being issued
    size_t end;  // past its last step
    std::vector<Set> sets;
    Graph* graph;  // stays made until the next operation's prepare
  };

  // Each run of puts of `r` with its graph, made before anything of the operation is enqueued
  // (its "ready" among it): a graph that cannot be made fails the call before any peer may
  // write here. (No operation is captured into a user's graph: the launch refuses capture,
  // device_work.hpp.)
  std::vector<Run> prepare(const StepRecording& r, const OpEnv& env);
  // On env.stream, after every signal issued before it.
  void launch(const Run& run, const StepRecording& r, const OpEnv& env);

 private:
  Run prepare_run(const StepRecording& r, size_t first, size_t end, const OpEnv& env);
  static std::vector<Set> sets_of(const StepRecording& r, size_t first, size_t end);
  Graph& graph_of(const std::vector<Set>& sets, const std::vector<uintptr_t>& key,
                  const StepRecording& r, const OpEnv& env);
  void build(const std::vector<Set>& sets, const StepRecording& r, const OpEnv& env, Graph& g);
  static void destroy(Graph& g);
  static GateOp gate_of(const Set& set, const StepRecording& r, const OpEnv& env, uint64_t* go,
                        cudaGraphConditionalHandle cond);

  GraphCache<Graph> graphs_{&PutGraphs::destroy};
};

}  // namespace odc
