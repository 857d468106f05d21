// Layer 2, a transport: the CUDA transport's pushes with a guessed destination on the copy
// engines. A pushed direct all-gather (Protocol::all_gather_direct) writes each rank's shard
// into a peer's output where the peer says, on the device, that it lies: an SM copy, since a
// copy engine needs its destination when the copy is enqueued. Where the host has a guess of
// that place (what the peer published: SegmentTable::publish_output), the write goes through a
// copy engine instead. The operation's guessed pushes run as one CUDA graph (made per set of
// places at first use and kept; FSDP's buffers recur) on its stream: a one-warp gate waits for
// the peers' "ready" and checks their descriptors as a put's gate does (put_graphs.hpp), then
// compares each peer's word with its guess; only where they are equal and the group has not
// failed does it open that push's conditional node, which holds its copy, and mark the push
// done (`hit`). The copies run one after another, which on 4 GPUs beat a stream per peer
// (performance.md). Each push's SM copy, on its lane after the graph, writes only where its
// guess missed.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "graph_cache.hpp"
#include "kernels.cuh"

namespace odc {

class GuessedPuts {
 public:
  struct Put {
    void* dst;
    const void* src;
    size_t bytes;
    const uint64_t* ready;  // the peer's counter, and its descriptor (null: unchecked)
    const uint64_t* desc;
    int peer;
    const uint64_t* where;  // the peer's word, and the guess
    uint64_t guess;
  };
  ~GuessedPuts();
  // On `stream`, the graph of `puts` (at most kMaxGatePeers) behind one gate of `check`; its
  // hits are marked with `serial`. Returns the hit words, one per put (device memory), which
  // the pushes' SM copies read after it.
  const uint64_t* launch(cudaStream_t stream, const std::vector<Put>& puts, const WaitCheck& check,
                         uint64_t serial);
  // On `stream`, once the operation's last reader of the hit words is ordered before it: the
  // last launch's graph (and its hit words) may be destroyed once this point has run.
  void done(cudaStream_t stream);
  // Pushes its gates examined so far, and those whose guess they confirmed (diagnostics: read
  // from the device on a stream of its own, so it waits for no collective).
  struct Tally {
    uint64_t examined = 0, confirmed = 0;
  };
  Tally tally();

 private:
  struct Graph {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    cudaGraphNode_t gate = nullptr;
    std::vector<cudaGraphConditionalHandle> conds;
    uint64_t* hits = nullptr;    // device memory, one per put
    cudaEvent_t last = nullptr;  // recorded after its last launch's readers (done)
  };
  Graph& graph_of(const std::vector<Put>& puts, cudaStream_t stream);
  void build(Graph& g, const std::vector<Put>& puts, cudaStream_t stream);
  GuessGateOp gate_of(const Graph& g, const std::vector<Put>& puts, const WaitCheck& check,
                      uint64_t serial);
  static void destroy(Graph& g);

  unsigned long long* tally_ = nullptr;  // device memory: Tally's two counts (GuessGateOp)
  cudaStream_t tally_stream_ = nullptr;
  GraphCache<Graph> graphs_{&GuessedPuts::destroy};
  Graph* launched_ = nullptr;  // the last launch's, until done()
};

}  // namespace odc
