// Layer 2, a transport's memory: NVSHMEM (device_memory.hpp), and its runtime. Depends on
// device_memory.hpp and the transport interface.
//
// NVSHMEM runtime for the NVSHMEM transport (peers on other hosts; runs on one host).
//
// Built only with ODC_WITH_NVSHMEM (setup.py: ODC_WITH_NVSHMEM=1). Host API only: the
// extension links libnvshmem_host and no NVSHMEM device code, so initialisation goes
// through nvshmemx_hostlib_init_attr (docs/multi_host.md).
//
// One initialisation per process over the default group's world (PE = global rank, as
// PyTorch's own NVSHMEM use assumes); a slab of the symmetric heap that groups sub-allocate
// their windows and arenas from; routed peers (ODC_TRANSPORT=nvshmem, or peers on other
// "hosts" of ODC_HOST_SIZE) reached with on-stream get / put / signal / quiet, the others
// through peer-to-peer mappings of the same slab; and a put-with-signal self-test.
// Network peers (routed peers NVSHMEM cannot map, nvshmem_ptr() == NULL: another host, or a
// remote transport on this one) need the local side of every get / put in memory NVSHMEM
// can use remotely: a copy whose local side is outside the slab (the user's tensors) goes
// through a staging room in this rank's slab, one per (ring, lane), in stream order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "device_memory.hpp"

namespace odc::nvshmem {

// A fresh unique id (call on global rank 0; broadcast the bytes to every rank).
std::vector<uint8_t> unique_id();

// Initialise once per process with rank 0's id, then allocate the slab (world-collective).
// Sets NVSHMEM_SYMMETRIC_SIZE to the slab + 512 MiB when unset (NVSHMEM reads its options
// once, at initialisation), and NVSHMEM_DISABLE_NVLS=1 when unset. If NVSHMEM is already
// initialised in this process (e.g. by PyTorch's symmetric memory), checks that its PE
// numbering matches (my PE == global_rank, PEs == world) and joins it. Returns false when
// it was already initialised.
bool init(const std::vector<uint8_t>& id, int global_rank, int world, int device, size_t slab_bytes);

// Add a segment of `bytes` to the slab (world-collective: every rank, same order, same size;
// torch_odc_backend.nvshmem agrees on it over the default group first).
void grow(size_t bytes);

// Windows for the CUDA transport from the slab; pe_of_rank[r] is group rank r's PE. Peers
// with routed[r] are reached through NVSHMEM's on-stream get / put / signal calls (peers on
// other hosts, or every peer when ODC_TRANSPORT=nvshmem forces it), the others through
// peer-to-peer mappings (nvshmem_ptr). Throws if NVSHMEM is not initialised.
// stage_always: stage every routed copy whose local side is outside the slab, also to peers
// NVSHMEM maps peer-to-peer (ODC_NVSHMEM_STAGE=always: runs the network path on one host).
std::unique_ptr<DeviceMemory> make_memory(std::vector<int> pe_of_rank, std::vector<bool> routed,
                                          int device, bool stage_always);

// Bytes of one group's staging rooms (world lanes x the rings of a transport), taken from the
// slab with the group's window when some peer is routed.
size_t stage_bytes(int world);

struct Status {
  int init_status = 0;  // nvshmemx_init_status(): 0 not initialised ... >= 2 initialised
  int my_pe = -1;
  int n_pes = 0;
  size_t slab_bytes = 0;  // odc's slab of the symmetric heap (0: none)
  size_t slab_used = 0;   // bytes of it handed to groups' windows and arenas
  std::vector<std::pair<size_t, size_t>> segments;  // (bytes, used) of each slab segment
  uint64_t routed_copies = 0;   // get / put calls issued to routed peers
  uint64_t routed_signals = 0;  // signals issued to routed peers
  uint64_t staged_copies = 0;   // routed get / put calls that went through a staging room
  uint64_t staged_bytes = 0;
  int network_peers = 0;        // routed peers NVSHMEM cannot map (seen by windows opened so far)
};
Status status();

struct SelfTest {
  int64_t mismatched_bytes = 0;  // bytes of the received block that differ from the sender's
  bool next_pe_is_p2p = false;   // nvshmem_ptr() gives a load/store pointer to the next PE
  double put_signal_wait_us = 0;  // device time of put-with-signal + the signal wait
};
// Collective over every PE: each PE puts `bytes` (its PE number + 1 in every byte) into
// the next PE's symmetric buffer with put-with-signal, waits on the stream for its own
// signal, and checks what it received. `stream` is a cudaStream_t (0: legacy default).
SelfTest ring_selftest(size_t bytes, void* stream);

}  // namespace odc::nvshmem
