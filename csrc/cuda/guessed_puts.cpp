// Layer 2, a transport: the CUDA transport's pushes with a guessed destination (guessed_puts.hpp).
#include "guessed_puts.hpp"

#include <stdexcept>

#include "device_memory.hpp"

namespace odc {

GuessedPuts::~GuessedPuts() {
  if (tally_) (void)cudaFree(tally_);
  if (tally_stream_) (void)cudaStreamDestroy(tally_stream_);
}

GuessedPuts::Tally GuessedPuts::tally() {
  unsigned long long t[2] = {0, 0};
  if (!tally_) return {};
  check(cudaMemcpyAsync(t, tally_, sizeof(t), cudaMemcpyDeviceToHost, tally_stream_), "reading the pushes' tally");
  check(cudaStreamSynchronize(tally_stream_), "reading the pushes' tally");
  return {t[0], t[1]};
}

void GuessedPuts::destroy(Graph& g) {  // parts not made yet are null
  if (g.exec) (void)cudaGraphExecDestroy(g.exec);
  if (g.graph) (void)cudaGraphDestroy(g.graph);
  if (g.last) (void)cudaEventDestroy(g.last);
  if (g.hits) (void)cudaFree(g.hits);
}

GuessGateOp GuessedPuts::gate_of(const Graph& g, const std::vector<Put>& puts, const WaitCheck& check,
                                 uint64_t serial) {
  GuessGateOp op{};
  op.n = static_cast<int>(puts.size());
  for (int i = 0; i < op.n; ++i) {
    op.flag[i] = puts[i].ready;
    op.desc[i] = puts[i].desc;
    op.peer[i] = puts[i].peer;
    op.where[i] = puts[i].where;
    op.guess[i] = puts[i].guess;
    op.cond[i] = g.conds[i];
  }
  op.check = check;
  op.hits = g.hits;
  op.serial = serial;
  op.tally = tally_;
  return op;
}

void GuessedPuts::build(Graph& g, const std::vector<Put>& puts, cudaStream_t stream) {
  check(cudaMalloc(&g.hits, puts.size() * sizeof(uint64_t)), "allocating the pushes' words");
  // on the stream the graph runs on: the legacy stream's memset has no order with it
  check(cudaMemsetAsync(g.hits, 0, puts.size() * sizeof(uint64_t), stream), "zeroing the pushes' words");
  check(cudaEventCreateWithFlags(&g.last, cudaEventDisableTiming), "creating an event");
  check(cudaGraphCreate(&g.graph, 0), "creating the pushes' graph");
  for (size_t i = 0; i < puts.size(); ++i) {
    cudaGraphConditionalHandle c;
    check(cudaGraphConditionalHandleCreate(&c, g.graph, 0, cudaGraphCondAssignDefault),
          "creating a push's condition");
    g.conds.push_back(c);
  }
  GuessGateOp op = gate_of(g, puts, WaitCheck{}, 0);  // its parameters are set at each launch
  void* args[1] = {&op};
  const cudaKernelNodeParams kp = guess_gate_node_params(args);
  check(cudaGraphAddKernelNode(&g.gate, g.graph, nullptr, 0, &kp), "adding the pushes' gate");
  cudaGraphNode_t prev = g.gate;
  for (size_t i = 0; i < puts.size(); ++i) {  // one after another
    cudaGraphNodeParams cp{};
    cp.type = cudaGraphNodeTypeConditional;
    cp.conditional.handle = g.conds[i];
    cp.conditional.type = cudaGraphCondTypeIf;
    cp.conditional.size = 1;
    cudaGraphNode_t node, copy;
#if CUDART_VERSION >= 13000
    check(cudaGraphAddNode(&node, g.graph, &prev, nullptr, 1, &cp), "adding a push's condition");
#else
    check(cudaGraphAddNode(&node, g.graph, &prev, 1, &cp), "adding a push's condition");
#endif
    check(cudaGraphAddMemcpyNode1D(&copy, cp.conditional.phGraph_out[0], nullptr, 0, puts[i].dst,
                                   puts[i].src, puts[i].bytes, cudaMemcpyDeviceToDevice),
          "adding a push's copy");
    prev = node;
  }
  check(cudaGraphInstantiate(&g.exec, g.graph, 0), "instantiating the pushes' graph");
}

GuessedPuts::Graph& GuessedPuts::graph_of(const std::vector<Put>& puts, cudaStream_t stream) {
  GraphCache<Graph>::Key key;  // where each push writes, from where, how much
  for (const Put& p : puts) {
    key.insert(key.end(), {reinterpret_cast<uintptr_t>(p.dst), reinterpret_cast<uintptr_t>(p.src), p.bytes});
  }
  if (Graph* g = graphs_.find(key)) return *g;
  graphs_.retire();
  return graphs_.add(key, [&](Graph& g) { build(g, puts, stream); });
}

const uint64_t* GuessedPuts::launch(cudaStream_t stream, const std::vector<Put>& puts,
                                    const WaitCheck& check_of, uint64_t serial) {
  if (puts.empty() || puts.size() > static_cast<size_t>(kMaxGatePeers)) {
    throw std::logic_error("odc: guessed pushes behind one gate: 1 to kMaxGatePeers");
  }
  if (!tally_) {
    check(cudaStreamCreateWithFlags(&tally_stream_, cudaStreamNonBlocking), "creating a stream");
    check(cudaMalloc(&tally_, 2 * sizeof(unsigned long long)), "allocating the pushes' tally");
    check(cudaMemsetAsync(tally_, 0, 2 * sizeof(unsigned long long), stream), "zeroing the pushes' tally");
  }
  Graph& g = graph_of(puts, stream);
  GuessGateOp op = gate_of(g, puts, check_of, serial);
  void* args[1] = {&op};
  const cudaKernelNodeParams kp = guess_gate_node_params(args);
  check(cudaGraphExecKernelNodeSetParams(g.exec, g.gate, &kp), "setting the pushes' gate");
  check(cudaGraphLaunch(g.exec, stream), "launching the pushes");
  launched_ = &g;
  return g.hits;
}

void GuessedPuts::done(cudaStream_t stream) {
  if (!launched_) return;
  check(cudaEventRecord(launched_->last, stream), "recording an event");
  launched_ = nullptr;
}

}  // namespace odc
