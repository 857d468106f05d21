// Layer 2, transport set-up: where a group's ranks are, worked out once when a channel is made
// (collective over the group, through its store: rendezvous.hpp): every rank's host, for CUDA
// also its GPU and which peers NVSHMEM routes (options.hpp), and from those whether odc's
// transports connect the group at all. Every rank computes the same placement.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "options.hpp"
#include "rendezvous.hpp"

namespace odc {

struct Placement {
  int rank = 0;
  // Every rank's host as it labels its own: its host name, with ODC_HOST_SIZE also its block
  // of global ranks (emulated hosts on one machine share a name).
  std::vector<std::string> hosts;
  // CUDA: every rank's GPU (its host name, '/', the GPU's UUID); empty for CPU tensors.
  std::vector<std::vector<uint8_t>> gpus;
  // CUDA: the peers this rank reaches through NVSHMEM's API (Options::routes_peer).
  std::vector<bool> routed;
  // Where two ranks on different hosts have no transport between them: the ranks by host,
  // "'a' (ranks 0, 1), 'b' (ranks 2, 3)" (their collectives go to the inner backend). Empty
  // where odc's transports connect every rank.
  std::string unconnected_hosts;

  // Some two ranks of the group use one GPU (NCCL refuses such groups). A fact of the group,
  // the same on every rank, unlike "another rank uses mine" (3 ranks on 2 GPUs: ranks 0 and 2
  // share one, rank 1 has the other alone).
  bool some_ranks_share_a_gpu() const;
  // The group's ranks on this rank's GPU, not routed (their kernels share its SMs). This
  // rank's own fact: it sizes only how this rank runs its steps, never what peers see.
  int ranks_on_gpu() const;
  // Some peer's memory is on another GPU of this host (CUDA IPC over NVLink).
  bool peers_on_other_gpus() const;
  // Every rank has a GPU of its own and no peer is routed (every peer's memory is mapped).
  bool own_gpus() const;
};

// This machine's host name (what ranks on one host share).
std::string host_name();

// CPU tensors: host shared memory connects the ranks of one host only.
Placement place_host_ranks(const TransportArgs& a, const Options& o);
// CUDA tensors on the GPU whose UUID is `gpu_uuid`: CUDA IPC connects one host's GPUs,
// NVSHMEM the peers it routes.
Placement place_gpu_ranks(const TransportArgs& a, const Options& o,
                          const std::vector<uint8_t>& gpu_uuid);

}  // namespace odc
