// Layer 2, transport set-up: the argument bundle a transport is created from and the window
// rendezvous through the group's store (used only while a transport is set up). Depends on
// the transport interface (transport.hpp) and c10d's Store.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "transport.hpp"

namespace odc {

struct TransportArgs {
  c10::intrusive_ptr<c10d::Store> store;  // the group's (prefixed) store
  int rank = 0;
  int world = 1;
  WindowLayout layout;
  // The group's timeout in ms, shared with its backend: setTimeout reaches the waits of
  // transports already running (read at each wait and each launch).
  std::shared_ptr<const std::atomic<int64_t>> timeout_ms;
  std::string key_prefix;  // distinguishes the transports of one group in the store

  std::chrono::milliseconds timeout() const {
    return std::chrono::milliseconds(timeout_ms ? timeout_ms->load(std::memory_order_relaxed) : 0);
  }
};

// Publish this rank's blob under `name`, return every rank's blob (index = rank).
std::vector<std::vector<uint8_t>> exchange_blobs(const TransportArgs& a, const std::string& name,
                                                 const std::vector<uint8_t>& mine);
// Every rank reaches this point (store-based; used only during set-up).
void store_barrier(const TransportArgs& a, const std::string& name);

}  // namespace odc
