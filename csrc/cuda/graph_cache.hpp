// Layer 2, a transport: the copy engines' cache of CUDA graphs (put_graphs.hpp,
// guessed_puts.hpp). A graph is made once per set of places and sizes (FSDP's buffers recur)
// and kept; past kMaxGraphs all are dropped, each destroyed once its last launch is done.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace odc {

template <typename Graph>  // with a cudaEvent_t `last`, recorded after its last launch
class GraphCache {
 public:
  using Key = std::vector<uintptr_t>;
  using Destroy = void (*)(Graph&);  // parts not made yet are null
  explicit GraphCache(Destroy destroy) : destroy_(destroy) {}
  ~GraphCache() {
    for (auto& [key, g] : graphs_) destroy_(g);
    for (auto& g : retired_) destroy_(g);
  }
  GraphCache(const GraphCache&) = delete;
  GraphCache& operator=(const GraphCache&) = delete;

  Graph* find(const Key& key) {
    auto it = graphs_.find(key);
    return it == graphs_.end() ? nullptr : &it->second;
  }
  // The graph `make` builds for `key`; one it throws from is destroyed.
  template <typename Make>
  Graph& add(const Key& key, Make&& make) {
    Graph g;
    try {
      make(g);
    } catch (...) {
      destroy_(g);
      throw;
    }
    try {
      return graphs_.emplace(key, std::move(g)).first->second;
    } catch (...) {
      destroy_(g);
      throw;
    }
  }
  // Destroys the dropped graphs whose last launch is done (past kMaxGraphs, rare: drops them all
  // first). Graphs found or added since the last call stay valid until the next.
  void retire() {
    if (graphs_.size() >= kMaxGraphs) {
      retired_.reserve(retired_.size() + graphs_.size());  // no throw halfway: none held twice
      for (auto& [key, g] : graphs_) retired_.push_back(g);
      graphs_.clear();
    }
    for (auto it = retired_.begin(); it != retired_.end();) {
      const cudaError_t e = cudaEventQuery(it->last);
      if (e != cudaSuccess) {  // still running (or failed: left to the checks that report it)
        if (e == cudaErrorNotReady) (void)cudaGetLastError();
        ++it;
        continue;
      }
      destroy_(*it);
      it = retired_.erase(it);
    }
  }

 private:
  static constexpr size_t kMaxGraphs = 1024;
  Destroy destroy_;
  std::map<Key, Graph> graphs_;
  std::vector<Graph> retired_;  // dropped from the map, destroyed once idle
};

}  // namespace odc
