// Layer 5, backend: what a collective needs from its device around a launch, behind one
// interface, so that the c10d face (backend.cpp) holds no device code: the stream it runs
// on, what its Work waits for, how registered memory is ordered on streams, and the release
// of a channel's device resources. Host tensors need none of it (a host collective has
// completed when the call returns); CUDA's is in cuda/cuda_device_work.cpp, and a build
// without CUDA links host_only.cpp instead.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <memory>
#include <vector>

#include "channel.hpp"
#include "pool.hpp"

namespace odc {

// The device side of a Work: its completion on the device (absent for host work).
class DeviceCompletion {
 public:
  virtual ~DeviceCompletion() = default;
  virtual bool done() = 0;  // isCompleted(): without blocking
  // wait(): blocks the host (a barrier's work, as NCCL's) or makes the caller's current
  // stream wait (nothing to do where that is the operation's stream). True if it blocked.
  virtual bool wait() = 0;
  // A Future completed with `outputs` when the work is (on a side stream that waits for it)
  virtual c10::intrusive_ptr<c10::ivalue::Future> future(const std::vector<at::Tensor>& outputs) = 0;
};

// One launch on a channel's device, from before its body to its Work.
class DeviceLaunch {
 public:
  virtual ~DeviceLaunch() = default;
  // The operation's stream (nullptr on the host): the caller's current one, or with
  // async_op the group's own, made current while the launch lives (scratch tensors belong
  // to it).
  virtual void* stream() const = 0;
  // After the body: tensors used on a stream the caching allocator does not know stay alive
  // there, and the completion the Work waits for (nullptr on the host).
  virtual std::unique_ptr<DeviceCompletion> finish(std::vector<at::Tensor>& keep,
                                                   std::vector<at::Tensor>& outputs,
                                                   bool blocking, bool ends_with_op) = 0;
};

// The caller's current stream of `device` for an operation of odc (`what`, for the error):
// nullptr on the host. Refuses (NotImplementedError, before anything is issued) a stream being
// captured into a CUDA graph: odc's waits and signals compare with counters that grow with every
// operation, so a replayed graph would find its waits already met and read before its peers
// wrote.
void* current_stream(const c10::Device& device, const char* what);
// Whether the caller's current stream of `device` is being captured into a CUDA graph (false on
// the host).
bool stream_is_capturing(const c10::Device& device);
// Begins a launch on `ch`'s device (the caller refused graph capture first: current_stream).
std::unique_ptr<DeviceLaunch> begin_launch(Channel& ch, bool async_op);
// The host's launch (no stream, nothing to wait for): what begin_launch gives host tensors.
std::unique_ptr<DeviceLaunch> host_launch();
// How registered memory of `device` is ordered on its streams (empty on the host).
RegisteredPool::StreamOrder stream_order(const c10::Device& device);
// A side stream of `device` for an arena's early reductions (nullptr on the host), and its return
// (kept for later arenas).
void* take_side_stream(const c10::Device& device);
void give_side_stream(const c10::Device& device, void* stream);
// When the group goes: finish device work that may still use the channel's windows, give
// back its side stream.
void release_device(Channel& ch);

}  // namespace odc
