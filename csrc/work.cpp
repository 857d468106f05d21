// Layer 5, backend: OdcWork (work.hpp).
#include "work.hpp"

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/exception.h>

namespace odc {

OdcWork::OdcWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs,
                 std::vector<at::Tensor> keep_alive, std::shared_ptr<Transport> transport,
                 std::unique_ptr<DeviceCompletion> completion)
    : Work(rank, type),
      outputs_(std::move(outputs)),
      keep_alive_(std::move(keep_alive)),
      transport_(std::move(transport)),
      completion_(std::move(completion)) {}

bool OdcWork::isCompleted() {
  raise_async_error();
  return !completion_ || completion_->done();
}

bool OdcWork::wait(std::chrono::milliseconds /*timeout*/) {
  raise_async_error();
  if (completion_ && completion_->wait()) raise_async_error();  // it blocked: the error may be new
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> OdcWork::getFuture() {
  std::lock_guard<std::mutex> lock(future_mu_);
  if (!future_) {
    if (completion_) {
      future_ = completion_->future(outputs_);
    } else {
      future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
      future_->markCompleted(c10::IValue(outputs_));
    }
  }
  return future_;
}

void OdcWork::raise_async_error() {
  const std::string err = transport_->async_error();
  if (!err.empty()) C10_THROW_ERROR(DistBackendError, err);
}

}  // namespace odc
