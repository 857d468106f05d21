// Layer 5, backend (CUDA): device_work.hpp for CUDA tensors: a collective runs on the
// caller's current stream, or with async_op on the group's own stream after it; its Work
// waits for an event recorded after it (Transport::completion); registered memory is
// ordered on streams by events. Host tensors get the host's launch.
#include "../cuda_setup.hpp"
#include "../device_work.hpp"
#include "../text.hpp"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Optional.h>

#include <cuda_runtime.h>

namespace odc {
namespace {

// The caller's current stream, refused while it is being captured (device_work.hpp,
// current_stream).
c10::cuda::CUDAStream current_cuda_stream(const c10::Device& device, const char* what) {
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device.index());
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &capturing));
  ODC_CHECK(capturing == cudaStreamCaptureStatusNone, NotImplementedError, "odc: ", what,
            " on ", device, " cannot be captured into a CUDA graph: odc's waits and signals "
            "compare with counters that grow with every operation, so a replay would find its "
            "waits already met and read before the peers wrote. Capture only the computation "
            "and run odc's collectives outside the graph, or use a NCCL group inside it");
  return stream;
}

// done: a cudaEvent_t recorded on op_stream after the work. blocking: wait() blocks the host.
class CudaCompletion final : public DeviceCompletion {
 public:
  CudaCompletion(std::shared_ptr<void> done, void* op_stream, c10::DeviceIndex device, bool blocking)
      : done_(std::move(done)), op_stream_(op_stream), device_(device), blocking_(blocking) {}

  bool done() override {
    const cudaError_t e = cudaEventQuery(event());
    if (e == cudaErrorNotReady) (void)cudaGetLastError();
    else C10_CUDA_CHECK(e);
    return e == cudaSuccess;
  }

  bool wait() override {
    if (blocking_) {
      C10_CUDA_CHECK(cudaEventSynchronize(event()));  // a device-side timeout ends the wait too
      return true;
    }
    cudaStream_t current = c10::cuda::getCurrentCUDAStream(device_).stream();
    if (current != op_stream_) C10_CUDA_CHECK(cudaStreamWaitEvent(current, event(), 0));
    return false;
  }

  // Marked on a side stream that waits for the work's event (not on the operation's
  // stream, which may carry later work by now).
  c10::intrusive_ptr<c10::ivalue::Future> future(const std::vector<at::Tensor>& outputs) override {
    auto future = c10::make_intrusive<c10::ivalue::Future>(
        c10::ListType::create(c10::TensorType::get()),
        std::vector<c10::Device>{c10::Device(c10::kCUDA, device_)});
    c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, device_);
    C10_CUDA_CHECK(cudaStreamWaitEvent(side.stream(), event(), 0));
    c10::cuda::CUDAStreamGuard on_side(side);
    future->markCompleted(c10::IValue(outputs));
    return future;
  }

 private:
  cudaEvent_t event() const { return static_cast<cudaEvent_t>(done_.get()); }
  std::shared_ptr<void> done_;
  void* op_stream_;
  c10::DeviceIndex device_;
  bool blocking_;
};

class CudaLaunch final : public DeviceLaunch {
 public:
  CudaLaunch(Channel& ch, bool async_op)
      : transport_(*ch.transport),
        async_op_(async_op),
        op_stream_(c10::cuda::getCurrentCUDAStream(ch.device.index())) {
    if (async_op) {  // the group's own stream, after the caller's work so far
      const c10::cuda::CUDAStream current = op_stream_;
      op_stream_ = c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(ch.async_stream),
                                                    ch.device.index());
      const std::shared_ptr<void> ready = transport_.completion(current.stream(), false);
      C10_CUDA_CHECK(cudaStreamWaitEvent(op_stream_.stream(), static_cast<cudaEvent_t>(ready.get()), 0));
      on_op_stream_.emplace(op_stream_);
    }
  }

  void* stream() const override { return op_stream_.stream(); }

  std::unique_ptr<DeviceCompletion> finish(std::vector<at::Tensor>& keep,
                                           std::vector<at::Tensor>& outputs, bool blocking,
                                           bool ends_with_op) override {
    if (async_op_) {  // tensors used on a stream the caching allocator does not know about
      for (auto* ts : {&keep, &outputs}) {
        for (auto& t : *ts) c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), op_stream_);
      }
    }
    return std::make_unique<CudaCompletion>(transport_.completion(op_stream_.stream(), ends_with_op),
                                            op_stream_.stream(), op_stream_.device_index(), blocking);
  }

 private:
  Transport& transport_;
  bool async_op_;
  c10::cuda::CUDAStream op_stream_;
  c10::optional<c10::cuda::CUDAStreamGuard> on_op_stream_;
};

}  // namespace

void* current_stream(const c10::Device& device, const char* what) {
  return device.is_cuda() ? current_cuda_stream(device, what).stream() : nullptr;
}

bool stream_is_capturing(const c10::Device& device) {
  if (!device.is_cuda()) return false;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(device.index()).stream(), &capturing));
  return capturing != cudaStreamCaptureStatusNone;
}

std::unique_ptr<DeviceLaunch> begin_launch(Channel& ch, bool async_op) {
  if (!ch.device.is_cuda()) return host_launch();
  return std::make_unique<CudaLaunch>(ch, async_op);
}

// The current stream allocates; a free records an event on the block's stream; a block
// freed on another stream is reused after that event.
RegisteredPool::StreamOrder stream_order(const c10::Device& device) {
  RegisteredPool::StreamOrder order;
  if (!device.is_cuda()) return order;
  const c10::DeviceIndex idx = device.index();
  order.current = [idx]() -> void* { return c10::cuda::getCurrentCUDAStream(idx).stream(); };
  order.record = [idx](void* stream) {
    c10::cuda::CUDAGuard g(idx);
    cudaEvent_t ev = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(ev, static_cast<cudaStream_t>(stream)));
    return std::shared_ptr<void>(ev, [idx](void* e) {
      c10::cuda::CUDAGuard g2(idx);
      (void)cudaEventDestroy(static_cast<cudaEvent_t>(e));
    });
  };
  order.done = [](const std::shared_ptr<void>& ev) {
    const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(ev.get()));
    if (e == cudaErrorNotReady) (void)cudaGetLastError();
    return e == cudaSuccess;
  };
  order.wait = [](void* stream, const std::shared_ptr<void>& ev) {
    C10_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream),
                                       static_cast<cudaEvent_t>(ev.get()), 0));
  };
  return order;
}

// Device work may still reference the windows: finish it before they are unmapped.
void release_device(Channel& ch) {
  if (!ch.device.is_cuda()) return;
  c10::cuda::CUDAGuard g(ch.device.index());
  (void)cudaDeviceSynchronize();
  if (ch.async_stream) give_async_stream(ch.device.index(), ch.async_stream);
}

void* take_side_stream(const c10::Device& device) {
  return device.is_cuda() ? take_async_stream(device.index()) : nullptr;
}

void give_side_stream(const c10::Device& device, void* stream) {
  if (device.is_cuda() && stream) give_async_stream(device.index(), stream);
}

}  // namespace odc
