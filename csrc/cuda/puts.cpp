// Layer 2, a transport: the CUDA transport's puts (cuda_transport.hpp, put_after): writes into
// a peer's memory that only a successful wait lets through. The fused kernel runs them as any
// other steps (a failed wait ends the lane); on the copy engines, where a queued copy cannot be
// cancelled, they run as a CUDA graph whose copies and signals sit in a conditional node that a
// gate kernel opens only when every check passed.
#include "cuda_transport.hpp"

#include <stdexcept>

namespace odc {

void CudaTransport::put_after(int lane, const uint64_t* flag, int peer, uint64_t target,
                                 const WaitSite& site, const DescCheck* check, void* dst,
                                 const void* src, size_t bytes, uint64_t* done) {
  const size_t first = steps_.size();
  wait(lane, {flag}, {peer}, target, site, check);
  if (bytes) copy(lane, dst, src, bytes);
  signal(lane, {done}, target);
  // The fused kernel skips a lane's later steps where its wait fails; the copy engines run
  // these as a conditional graph (issue_puts).
  for (size_t i = first; i < steps_.size(); ++i) steps_[i].guarded = true;
}

WaitCheck CudaTransport::wait_check(const Step& w) const {
  WaitCheck c{};
  c.target = w.value;
  c.desc_expected = w.desc;
  c.desc_id = w.desc_id;
  c.timeout_ns = static_cast<unsigned long long>(a_.timeout().count()) * 1000000ull;
  c.op_seq = w.site.op_seq;
  c.op = w.site.op;
  c.what = w.site.what;
  c.err = err_dev_;
  c.watch_slots = watch_.slots;
  c.watch_word = watch_.word;
  return c;
}

// The gate of the puts whose waits are `waits`: their counters, target and checks, the group's
// timeout, error record and watch.
GateOp CudaTransport::gate_of(const std::vector<const Step*>& waits, uint64_t* go,
                                 cudaGraphConditionalHandle cond) const {
  GateOp g{};
  const Step& w = *waits.front();
  g.n = static_cast<int>(waits.size());
  for (int i = 0; i < g.n; ++i) {
    const Step& x = *waits[i];
    if (x.value != w.value || x.desc != w.desc || x.desc_id != w.desc_id) {
      throw std::logic_error("odc: the puts of one gate wait for the same number and check");
    }
    g.flag[i] = static_cast<const uint64_t*>(ptrs_[x.first]);
    g.desc[i] = x.desc ? static_cast<const uint64_t*>(ptrs_[x.first + x.n]) : nullptr;
    g.peer[i] = peers_[x.first];
  }
  g.check = wait_check(w);
  g.go = go;
  g.cond = cond;
  return g;
}

// The puts in steps_[first, end) (each: a wait on one counter, a copy unless empty, a signal
// of one counter), behind as few gates as hold them.
std::vector<CudaTransport::PutSet> CudaTransport::put_sets(size_t first, size_t end) const {
  std::vector<PutSet> sets;
  for (size_t i = first; i < end;) {
    const Step* w = &steps_[i++];
    const Step* data = i < end && steps_[i].kind == kStepCopy ? &steps_[i++] : nullptr;
    const Step* sig = i < end ? &steps_[i++] : nullptr;
    if (w->kind != kStepWait || w->n != 1 || !sig || sig->kind != kStepSignal || sig->n != 1 ||
        sig->value != w->value) {
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
CudaTransport::PutGraph& CudaTransport::put_graph(const std::vector<PutSet>& sets,
                                                        const std::vector<uintptr_t>& key) {
  auto it = put_graphs_.find(key);
  if (it != put_graphs_.end()) return it->second;
  PutGraph g;
  try {
    build_puts(sets, g);
  } catch (...) {
    destroy(g);
    throw;
  }
  return put_graphs_.emplace(key, std::move(g)).first->second;
}

// Once per operation with puts, before any is prepared (so that the graphs it prepares stay).
void CudaTransport::retire_puts() {
  constexpr size_t kMaxPutGraphs = 1024;
  if (put_graphs_.size() >= kMaxPutGraphs) {  // rare: drop them all, each once its last launch is done
    for (auto& [k, g] : put_graphs_) retired_puts_.push_back(g);
    put_graphs_.clear();
  }
  for (auto it = retired_puts_.begin(); it != retired_puts_.end();) {
    if (cudaEventQuery(it->last) != cudaSuccess) {
      ++it;
      continue;
    }
    destroy(*it);
    it = retired_puts_.erase(it);
  }
}

void CudaTransport::build_puts(const std::vector<PutSet>& sets, PutGraph& g) {
  size_t puts = 0;
  for (const PutSet& set : sets) puts += set.waits.size();
  check(cudaMalloc(&g.go, puts * sizeof(uint64_t)), "allocating the puts' words");
  check(cudaEventCreateWithFlags(&g.last, cudaEventDisableTiming), "creating an event");
  check(cudaGraphCreate(&g.graph, 0), "creating the puts' graph");
  cudaGraphNode_t prev = nullptr;
  uint64_t* go = g.go;
  for (const PutSet& set : sets) {
    cudaGraphConditionalHandle cond;
    check(cudaGraphConditionalHandleCreate(&cond, g.graph, 0, cudaGraphCondAssignDefault),
          "creating a put's condition");
    GateOp op = gate_of(set.waits, go, cond);
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
      if (const Step* data = set.copies[k]) {
        cudaGraphNode_t n;
        check(cudaGraphAddMemcpyNode1D(&n, body, last ? &last : nullptr, last ? 1 : 0, data->dst,
                                       data->src, data->value, cudaMemcpyDeviceToDevice),
              "adding a put's copy");
        last = n;
      }
      sig.done[k] = static_cast<uint64_t*>(const_cast<void*>(ptrs_[set.signals[k]->first]));
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

// Before anything of the operation is enqueued (its "ready" among it): a graph that cannot
// be made fails the call before any peer may write here. (No operation is captured into a
// user's graph: the launch refuses capture, device_work.hpp.)
CudaTransport::PutRun CudaTransport::prepare_puts(size_t first, size_t end) {
  std::vector<uintptr_t> key;  // where each put reads, writes and signals
  for (size_t i = first; i < end; ++i) {
    const Step& s = steps_[i];
    if (memory_->routed(s.dst) || (s.kind != kStepCopy && memory_->routed(ptrs_[s.first]))) {
      throw std::logic_error("odc: a put to a peer reached through NVSHMEM");  // no pool there
    }
    key.push_back(s.kind);
    if (s.kind == kStepCopy) {
      key.insert(key.end(), {reinterpret_cast<uintptr_t>(s.dst), reinterpret_cast<uintptr_t>(s.src), s.value});
    } else {
      for (int j = 0; j < (s.desc ? 2 : 1) * s.n; ++j) key.push_back(reinterpret_cast<uintptr_t>(ptrs_[s.first + j]));
    }
  }
  PutRun run{put_sets(first, end), nullptr};
  run.graph = &put_graph(run.sets, key);
  return run;
}

void CudaTransport::issue_puts(const PutRun& run) {
  // After every signal issued before them (this rank's "ready" among them), as a wait.
  for (int lane = 0; lane < a_.world; ++lane) flush_signals(lane);
  PutGraph& g = *run.graph;
  uint64_t* go = g.go;
  size_t k = 0;
  for (const PutSet& set : run.sets) {  // this operation's numbers and checks
    GateOp op = gate_of(set.waits, go, g.conds[k]);
    void* args[1] = {&op};
    const cudaKernelNodeParams kp = gate_node_params(args);
    check(cudaGraphExecKernelNodeSetParams(g.exec, g.gates[k], &kp), "setting a put's gate");
    go += set.waits.size();
    ++k;
  }
  check(cudaGraphLaunch(g.exec, op_stream_), "launching the puts");
  check(cudaEventRecord(g.last, op_stream_), "recording an event");
  flagged_[0] = true;  // the gates: one block at a time
}

void CudaTransport::destroy(PutGraph& g) {  // parts not made yet are null
  if (g.exec) (void)cudaGraphExecDestroy(g.exec);
  if (g.graph) (void)cudaGraphDestroy(g.graph);
  if (g.last) (void)cudaEventDestroy(g.last);
  if (g.go) (void)cudaFree(g.go);
}

}  // namespace odc
