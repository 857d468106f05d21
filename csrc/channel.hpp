// Layer 4, channel: one transport + protocol per device type a group moves data on, and
// the transport factory that makes them from the group's options. Depends on the options
// (options.hpp), the protocol (protocol.hpp) and the transport interface; the concrete
// transports (transport_shm.hpp, cuda/) only in channel.cpp.
#pragma once

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>

#include "options.hpp"
#include "pool.hpp"
#include "protocol.hpp"
#include "transport.hpp"

namespace odc {

// One transport + protocol per device type this group has moved data on.
struct Channel {
  std::unique_ptr<Transport> transport;
  std::unique_ptr<Protocol> protocol;
  c10::Device device{c10::kCPU};
  void* async_stream = nullptr;  // CUDA: the side stream async ops run on (a PyTorch pool stream)
  bool shares_device = false;    // CUDA: some ranks of the group use the same GPU
  // Registered memory (allocate_tensor), made at its first use; shared with the tensors'
  // deleters.
  std::shared_ptr<RegisteredPool> pool;
};

// Sets up `device`'s transport for a group (collective over the group: every rank calls it
// with its own device of that type): the group's name, timeout and global ranks come from
// `options`. Errors name the group and what to change.
Channel make_channel(const c10::Device& device, const Options& options,
                     const c10::intrusive_ptr<c10d::Store>& store, int rank, int size);

}  // namespace odc
