// Layer 5, backend: the Work of a one-sided collective.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <memory>
#include <mutex>
#include <vector>

#include "device_work.hpp"
#include "transport.hpp"

namespace odc {

// Host work is complete when returned. Device work completes on the operation's stream, and
// wait() only makes the caller's current stream wait for it (the host never blocks but for a
// barrier's work, as NCCL's). Errors the transport found asynchronously (a peer that timed
// out) are raised by isCompleted() and wait(). Its Future is made at the first getFuture():
// most callers never ask, and making one costs an event and a walk of the outputs.
class OdcWork final : public c10d::Work {
 public:
  OdcWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs,
          std::vector<at::Tensor> keep_alive, std::shared_ptr<Transport> transport,
          std::unique_ptr<DeviceCompletion> completion);

  bool isCompleted() override;
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds timeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override { return outputs_; }

 private:
  void raise_async_error();

  std::vector<at::Tensor> outputs_;
  std::vector<at::Tensor> keep_alive_;  // inputs stay alive until the work is dropped
  std::shared_ptr<Transport> transport_;
  std::unique_ptr<DeviceCompletion> completion_;  // nullptr: host work
  std::mutex future_mu_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace odc
