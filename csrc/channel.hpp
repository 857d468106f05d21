// Layer 4, channel: one transport + protocol per device type a group moves data on, and
// the choice that makes them from the group's options and where its ranks are. Depends on
// the options (options.hpp), the protocol (protocol.hpp), registered memory's pool (pool.hpp)
// and the transport interface; the transports' factories (transport_shm.hpp, cuda_setup.hpp)
// only in channel.cpp.
#pragma once

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <string>

#include "options.hpp"
#include "pool.hpp"
#include "protocol.hpp"
#include "transport.hpp"

namespace odc {

// One transport + protocol per device type this group has moved data on; none where the
// group's ranks are on several hosts that odc's transports do not connect (`hosts`).
struct Channel {
  // Shared with the Works of its collectives: a Work may outlive the group (its wait() and
  // isCompleted() read the transport's asynchronous error).
  std::shared_ptr<Transport> transport;
  // What the transport offers beyond the core (transport.hpp), looked up once when the
  // channel is made; null where it does not.
  ZeroCopyReads* zero_copy = nullptr;  // direct collectives (ODC_ZERO_COPY)
  Arenas* arenas = nullptr;            // decoupled mode and registered memory
  std::unique_ptr<Protocol> protocol;
  c10::Device device{c10::kCPU};
  // Where the group's ranks are on several hosts that no odc transport connects (CPU
  // tensors; CUDA without NVSHMEM): "'a' (ranks 0, 1), 'b' (ranks 2, 3)". The channel then
  // has no transport: the inner backend (NCCL, gloo) serves the group's collectives.
  std::string hosts;
  // Why no odc transport crosses those hosts, and what to do (with `hosts`, for errors).
  std::string hosts_why;
  void* async_stream = nullptr;  // CUDA: the side stream async ops run on (cuda_setup.hpp)
  bool shares_device = false;    // CUDA: some ranks of the group use the same GPU
  bool own_gpus = false;         // CUDA: every rank has a GPU of its own, every peer mapped
  // Zero-copy all-gathers push each rank's shard into its peers' outputs instead of reading
  // theirs (ODC_AG_PUSH; auto: where every rank of the group has a GPU of its own on this host,
  // 3 ranks or more). The same on every rank: decided from what every rank sees alike.
  bool push_all_gather = false;
  // Registered memory (allocate_tensor), made at its first use; shared with the tensors'
  // deleters.
  std::shared_ptr<RegisteredPool> pool;
};

struct Placement;
// What a CUDA channel decides from where the group's ranks are, with knobs the ranks agreed on
// (agreement.hpp): the same on every rank, since the placement is the group's.
struct PlacementChoices {
  bool shares_device = false;    // Channel::shares_device
  bool own_gpus = false;         // Channel::own_gpus
  bool push_all_gather = false;  // Channel::push_all_gather
};
PlacementChoices placement_choices(const Placement& p, const Options& o);

// Sets up `device`'s transport for a group (collective over the group: every rank calls it
// with its own device of that type): the group's name and global ranks come from `options`,
// its timeout from `timeout_ms` (the backend's, so that a changed timeout reaches the
// transport). Errors name the group and what to change.
Channel make_channel(const c10::Device& device, const Options& options,
                     std::shared_ptr<const std::atomic<int64_t>> timeout_ms,
                     const c10::intrusive_ptr<c10d::Store>& store, int rank, int size);

// The error of an operation odc must serve one-sidedly (`what`: "odc.decouple", "ALLREDUCE")
// on a channel whose group spans hosts odc does not connect (Channel::hosts).
std::string cross_host_refusal(const Channel& ch, const Options& options, const std::string& what);

}  // namespace odc
