// Pieces every transport shares: window rendezvous through the group's store,
// the error type, and the argument bundle a transport is created from.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "protocol.hpp"

namespace odc {

// A communication failure (timeout, dead peer). The group cannot be used after it.
struct CommError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct TransportArgs {
  c10::intrusive_ptr<c10d::Store> store;  // the group's (prefixed) store
  int rank = 0;
  int world = 1;
  WindowLayout layout;
  std::chrono::milliseconds timeout{0};
  std::string key_prefix;  // distinguishes the transports of one group in the store
};

// Publish this rank's blob under `name`, return every rank's blob (index = rank).
std::vector<std::vector<uint8_t>> exchange_blobs(const TransportArgs& a, const std::string& name,
                                                 const std::vector<uint8_t>& mine);
// Every rank reaches this point (store-based; used only during set-up).
void store_barrier(const TransportArgs& a, const std::string& name);

std::string describe_wait(const WaitSite& site, int peer, uint64_t target, uint64_t seen,
                          std::chrono::milliseconds timeout);
// "all_gather of 32 bytes per rank (float32)", from an op_desc() word.
std::string describe_desc(uint64_t desc);
// The error of a failed DescCheck: `rank` expected descriptor `mine` with chunk `chunk`,
// `peer` stored `theirs` with chunk `their_chunk`.
std::string describe_mismatch(const WaitSite& site, int rank, int peer, uint64_t mine,
                              uint64_t theirs, uint64_t chunk, uint64_t their_chunk);
// The error of a watched wait (PeerWatch): `peer` announced `theirs` under the number of
// this rank's announcement `mine`.
std::string describe_announced(const WaitSite& site, int rank, int peer, uint64_t mine,
                               uint64_t theirs);

}  // namespace odc
