// Layer 2, a transport: the CUDA transport's puts on the copy engines (put_graphs.hpp).
#include "put_graphs.hpp"

#include <stdexcept>

namespace odc {

// The gate of the puts of `set`: their counters, target and checks, the group's timeout, error
// record and watch.
GateOp PutGraphs::gate_of(const Set& set, const StepRecording& r, const OpEnv& env, uint64_t* go,
                          cudaGraphConditionalHandle cond) {
  GateOp g{};
  const WaitStep& w = *set.waits.front();
  g.n = static_cast<int>(set.waits.size());
  for (int i = 0; i < g.n; ++i) {
    const WaitStep& x = *set.waits[i];
    if (x.target != w.target || x.checked != w.checked || x.desc != w.desc || x.desc_id != w.desc_id) {
      throw std::logic_error("odc: the puts of one gate wait for the same number and check");
    }
    g.flag[i] = r.counter(x.counters.first);
    g.desc[i] = x.checked ? r.counter(x.counters.first + x.counters.n) : nullptr;
    g.peer[i] = r.peer(x.counters.first);
  }
  g.check = wait_check(w, env);
  g.go = go;
  g.cond = cond;
  return g;
}

// The puts in steps [first, end) (each: a wait on one counter, a copy unless empty, a signal of
// one counter), behind as few gates as hold them.
std::vector<PutGraphs::Set> PutGraphs::sets_of(const StepRecording& r, size_t first, size_t end) {
  std::vector<Set> sets;
  const std::vector<Step>& steps = r.steps();
  for (size_t i = first; i < end;) {
    const WaitStep* w = steps[i++].as<WaitStep>();
    const CopyStep* data = i < end ? steps[i].as<CopyStep>() : nullptr;
    if (data) ++i;
    const SignalStep* sig = i < end ? steps[i++].as<SignalStep>() : nullptr;
    if (!w || w->counters.n != 1 || !sig || sig->counters.n != 1 || sig->value != w->target) {
      throw std::logic_error("odc: a put is a wait, a copy and a signal of one counter");
    }
    if (sets.empty() || sets.back().waits.size() == kMaxGatePeers) sets.emplace_back();
    sets.back().waits.push_back(w);
    sets.back().copies.push_back(data);
    sets.back().signals.push_back(sig);
  }
  return sets;
}

// The graph of the puts of `sets`, made once per set of places and sizes (`key`).
PutGraphs::Graph& PutGraphs::graph_of(const std::vector<Set>& sets,
                                      const std::vector<uintptr_t>& key, const StepRecording& r,
                                      const OpEnv& env) {
  if (Graph* g = graphs_.find(key)) return *g;
  return graphs_.add(key, [&](Graph& g) { build(sets, r, env, g); });
}

void PutGraphs::build(const std::vector<Set>& sets, const StepRecording& r, const OpEnv& env,
                      Graph& g) {
  size_t puts = 0;
  for (const Set& set : sets) puts += set.waits.size();
  check(cudaMalloc(&g.go, puts * sizeof(uint64_t)), "allocating the puts' words");
  check(cudaEventCreateWithFlags(&g.last, cudaEventDisableTiming), "creating an event");
  check(cudaGraphCreate(&g.graph, 0), "creating the puts' graph");
  cudaGraphNode_t prev = nullptr;
  uint64_t* go = g.go;
  for (const Set& set : sets) {
    cudaGraphConditionalHandle cond;
    check(cudaGraphConditionalHandleCreate(&cond, g.graph, 0, cudaGraphCondAssignDefault),
          "creating a put's condition");
    GateOp op = gate_of(set, r, env, go, cond);
    void* args[1] = {&op};
    const cudaKernelNodeParams kp = gate_node_params(args);
    cudaGraphNode_t gate, node;
    check(cudaGraphAddKernelNode(&gate, g.graph, prev ? &prev : nullptr, prev ? 1 : 0, &kp),
          "adding a put's gate");
    cudaGraphNodeParams cp{};
    cp.type = cudaGraphNodeTypeConditional;
    cp.conditional.handle = cond;
    cp.conditional.type = cudaGraphCondTypeIf;
    cp.conditional.size = 1;
#if CUDART_VERSION >= 13000
    check(cudaGraphAddNode(&node, g.graph, &gate, nullptr, 1, &cp), "adding a put's condition");
#else  // CUDA 12.x: no edge data (conditional nodes with copies in their body need 12.4+)
    check(cudaGraphAddNode(&node, g.graph, &gate, 1, &cp), "adding a put's condition");
#endif
    cudaGraph_t body = cp.conditional.phGraph_out[0];
    cudaGraphNode_t last = nullptr;  // the body runs its copies one after another, then signals
    PutSignalOp sig{};
    sig.go = go;
    sig.n = static_cast<int>(set.waits.size());
    for (size_t k = 0; k < set.waits.size(); ++k) {
      if (const CopyStep* data = set.copies[k]) {
        cudaGraphNode_t n;
        check(cudaGraphAddMemcpyNode1D(&n, body, last ? &last : nullptr, last ? 1 : 0, data->dst,
                                       data->src, data->bytes, cudaMemcpyDeviceToDevice),
              "adding a put's copy");
        last = n;
      }
      sig.done[k] = r.counter(set.signals[k]->counters.first);
    }
    void* sig_args[1] = {&sig};
    const cudaKernelNodeParams sp = put_signal_node_params(sig_args);
    cudaGraphNode_t signalled;
    check(cudaGraphAddKernelNode(&signalled, body, last ? &last : nullptr, last ? 1 : 0, &sp),
          "adding the puts' signals");
    go += set.waits.size();
    g.gates.push_back(gate);
    g.conds.push_back(cond);
    prev = node;
  }
  check(cudaGraphInstantiate(&g.exec, g.graph, 0), "instantiating the puts' graph");
}

std::vector<PutGraphs::Run> PutGraphs::prepare(const StepRecording& r, const OpEnv& env) {
  std::vector<Run> runs;
  const std::vector<Step>& steps = r.steps();
  for (size_t i = 0; i < steps.size(); ++i) {
    if (!steps[i].guarded) continue;
    if (runs.empty()) graphs_.retire();  // before any is prepared: the ones it prepares stay
    size_t end = i;
    while (end < steps.size() && steps[end].guarded) ++end;
    runs.push_back(prepare_run(r, i, end, env));
    i = end - 1;
  }
  return runs;
}

PutGraphs::Run PutGraphs::prepare_run(const StepRecording& r, size_t first, size_t end,
                                      const OpEnv& env) {
  std::vector<uintptr_t> key;  // where each put reads, writes and signals
  for (size_t i = first; i < end; ++i) {
    const Step& s = r.steps()[i];
    key.push_back(s.kind());
    if (const CopyStep* c = s.as<CopyStep>()) {
      if (env.memory.routed(c->dst)) {
        throw std::logic_error("odc: a put to a peer reached through NVSHMEM");  // no pool there
      }
      key.insert(key.end(), {reinterpret_cast<uintptr_t>(c->dst), reinterpret_cast<uintptr_t>(c->src), c->bytes});
      continue;
    }
    const int first_word = s.as<WaitStep>() ? s.as<WaitStep>()->counters.first
                                            : s.as_signal()->counters.first;
    if (env.memory.routed(r.word(first_word))) {
      throw std::logic_error("odc: a put to a peer reached through NVSHMEM");
    }
    for (int j = 0; j < s.words(); ++j) key.push_back(reinterpret_cast<uintptr_t>(r.word(first_word + j)));
  }
  Run run{end, sets_of(r, first, end), nullptr};
  run.graph = &graph_of(run.sets, key, r, env);
  return run;
}

void PutGraphs::launch(const Run& run, const StepRecording& r, const OpEnv& env) {
  Graph& g = *run.graph;
  uint64_t* go = g.go;
  size_t k = 0;
  for (const Set& set : run.sets) {  // this operation's numbers and checks
    GateOp op = gate_of(set, r, env, go, g.conds[k]);
    void* args[1] = {&op};
    const cudaKernelNodeParams kp = gate_node_params(args);
    check(cudaGraphExecKernelNodeSetParams(g.exec, g.gates[k], &kp), "setting a put's gate");
    go += set.waits.size();
    ++k;
  }
  check(cudaGraphLaunch(g.exec, env.stream), "launching the puts");
  check(cudaEventRecord(g.last, env.stream), "recording an event");
}

void PutGraphs::destroy(Graph& g) {  // parts not made yet are null
  if (g.exec) (void)cudaGraphExecDestroy(g.exec);
  if (g.graph) (void)cudaGraphDestroy(g.graph);
  if (g.last) (void)cudaEventDestroy(g.last);
  if (g.go) (void)cudaFree(g.go);
}

}  // namespace odc
