// Device kernels of the CUDA IPC transport (launchers callable from host code).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "protocol.hpp"

namespace odc {

// Written by a device-side wait that timed out; read by the host (mapped memory).
struct DeviceError {
  int code;  // 0: none, 1: a wait timed out
  int peer;
  unsigned long long op_seq;
  unsigned long long target;
  unsigned long long seen;
  const char* op;    // WaitSite strings are literals: their addresses stay valid
  const char* what;
};

constexpr int kMaxPeers = 64;

// Store `signal_value` into each signal counter (announcing the work that
// precedes this kernel on its stream), then wait until every wait counter is
// >= wait_target, or record a timeout in `err` and return.
struct FlagOp {
  uint64_t* signal[kMaxPeers];
  const uint64_t* wait[kMaxPeers];
  int wait_peer[kMaxPeers];
  int n_signal;
  int n_wait;
  unsigned long long signal_value;
  unsigned long long wait_target;
  unsigned long long timeout_ns;
  unsigned long long op_seq;
  const char* op;
  const char* what;
  DeviceError* err;
};

struct ReduceOpArgs {
  const void* src[kMaxPeers];
  int n_src;
  void* dst;
  size_t numel;
  float scale;
  const float* scale_ptr;  // overrides `scale` when set (device pointer)
  bool vectorized;        // every pointer 16-byte aligned
};

cudaError_t launch_flag_op(const FlagOp& op, cudaStream_t stream);
// Load every kernel's module now. Under lazy loading (PyTorch's default) the
// first launch of a kernel may wait for the kernels already running, and a
// running flag kernel may be waiting for a peer that is itself stuck loading:
// a cross-rank deadlock. Loading up front removes it.
cudaError_t preload_kernels();
cudaError_t launch_reduce(const ReduceOpArgs& args, DType dtype, int blocks, cudaStream_t stream);

}  // namespace odc
