// Layer 5, backend: the collectives FSDP does not issue (backend.hpp): served by the inner
// backend of the tensors' device type (NCCL, gloo), or by odc itself (own_collectives.cpp)
// where ODC_SELF_SERVE says so.
#include "backend.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/exception.h>

#include "text.hpp"

namespace odc {

// ---- Delegation to the inner backend of the tensors' device type.

c10::intrusive_ptr<c10d::Backend> OdcBackend::inner(c10::DeviceType type) {
  settle_default_backend_type();
  std::lock_guard<std::mutex> lock(inner_mu_);
  {
    std::lock_guard<std::mutex> state(mu_);
    check_usable();
  }
  auto it = inners_.find(type);
  if (it != inners_.end()) return it->second;
  ODC_CHECK(inner_factory_, Error, "odc: no inner backend factory for delegated collectives");
  auto b = inner_factory_(store_, getRank(), getSize(), options_, type == c10::kCUDA ? "cuda" : "cpu");
  ODC_CHECK(b, Error, "odc: could not create the inner backend for ", c10::DeviceTypeName(type));
  b->setTimeout(options_->timeout);  // the group's, as setTimeout last set it
  inners_[type] = b;
  return b;
}

#define ODC_DELEGATE(device_type, call)       \
  do {                                        \
    count(Stat::DelegatedOps, 1);             \
    return inner(device_type)->call;          \
  } while (0)

// The collectives FSDP does not issue go to the inner backend, or to odc itself where that
// cannot serve them or they are small (serves_itself: own_collectives.cpp). `bytes`: per rank,
// from what every rank passes alike (SIZE_MAX: never small).
#define ODC_SERVE_OR_DELEGATE(device, bytes, own, call) \
  do {                                                  \
    const c10::Device dev_ = (device);                  \
    if (serves_itself(dev_, (bytes))) return own;       \
    ODC_DELEGATE(dev_.type(), call);                    \
  } while (0)

namespace {
size_t bytes_of(const std::vector<at::Tensor>& ts) {
  size_t n = 0;
  for (const auto& t : ts) n += static_cast<size_t>(t.numel()) * t.element_size();
  return n;
}
// A reduction's: SIZE_MAX where odc's own reductions do not take its dtype or op (NCCL may).
size_t reduced_bytes(const std::vector<at::Tensor>& ts, const c10d::ReduceOp& op) {
  for (const auto& t : ts) {
    if (!odc_reduces(t.scalar_type(), op)) return SIZE_MAX;
  }
  return bytes_of(ts);
}
// A list collective's mean piece, from the list every rank holds alike (an uneven all-gather's
// own input differs between ranks; the list's sum does not).
size_t mean_bytes_of(const std::vector<std::vector<at::Tensor>>& lists) {
  return lists.empty() || lists[0].empty() ? 0 : bytes_of(lists[0]) / lists[0].size();
}
// A list reduce-scatter's piece: SIZE_MAX where the pieces differ (odc's own takes even ones
// only; NCCL's reduces each in turn) or odc does not reduce them.
size_t even_reduced_bytes(const std::vector<std::vector<at::Tensor>>& lists, const c10d::ReduceOp& op) {
  if (lists.empty() || lists[0].empty()) return 0;
  for (const auto& t : lists[0]) {
    if (t.numel() != lists[0][0].numel()) return SIZE_MAX;
  }
  const size_t all = reduced_bytes(lists[0], op);
  return all == SIZE_MAX ? all : all / lists[0].size();
}
}  // namespace


c10::intrusive_ptr<c10d::Work> OdcBackend::broadcast(std::vector<at::Tensor>& t,
                                                     const c10d::BroadcastOptions& o) {
  ODC_SERVE_OR_DELEGATE(device_of(t), bytes_of(t), own_broadcast(t, o), broadcast(t, o));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::allreduce(std::vector<at::Tensor>& t,
                                                     const c10d::AllreduceOptions& o) {
  ODC_SERVE_OR_DELEGATE(device_of(t), reduced_bytes(t, o.reduceOp),
                        own_allreduce(t, o.reduceOp, o.asyncOp, "all_reduce"),
                        allreduce(t, o));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::allreduce_coalesced(
    std::vector<at::Tensor>& t, const c10d::AllreduceCoalescedOptions& o) {
  ODC_SERVE_OR_DELEGATE(device_of(t), reduced_bytes(t, o.reduceOp),
                        own_allreduce(t, o.reduceOp, o.asyncOp, "all_reduce_coalesced"),
                        allreduce_coalesced(t, o));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::reduce(std::vector<at::Tensor>& t,
                                                  const c10d::ReduceOptions& o) {
  ODC_SERVE_OR_DELEGATE(device_of(t), reduced_bytes(t, o.reduceOp), own_reduce(t, o), reduce(t, o));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::allgather(std::vector<std::vector<at::Tensor>>& out,
                                                     std::vector<at::Tensor>& in,
                                                     const c10d::AllgatherOptions& o) {
  ODC_SERVE_OR_DELEGATE(device_of(in), mean_bytes_of(out), own_allgather(out, in, o),
                        allgather(out, in, o));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
    const c10d::AllgatherOptions& o) {
  ODC_DELEGATE(device_of(in).type(), allgather_coalesced(out, in, o));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::gather(std::vector<std::vector<at::Tensor>>& out,
                                                  std::vector<at::Tensor>& in,
                                                  const c10d::GatherOptions& o) {
  ODC_SERVE_OR_DELEGATE(device_of(in), SIZE_MAX, own_gather(out, in, o),  // sizes may differ
                        gather(out, in, o));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::scatter(std::vector<at::Tensor>& out,
                                                   std::vector<std::vector<at::Tensor>>& in,
                                                   const c10d::ScatterOptions& o) {
  ODC_SERVE_OR_DELEGATE(device_of(out), SIZE_MAX, own_scatter(out, in, o),  // sizes may differ
                        scatter(out, in, o));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::reduce_scatter(
    std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
    const c10d::ReduceScatterOptions& o) {
  ODC_SERVE_OR_DELEGATE(device_of(out), even_reduced_bytes(in, o.reduceOp),
                        own_reduce_scatter(out, in, o),
                        reduce_scatter(out, in, o));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::alltoall_base(at::Tensor& out, at::Tensor& in,
                                                         std::vector<int64_t>& os,
                                                         std::vector<int64_t>& is,
                                                         const c10d::AllToAllOptions& o) {
  ODC_SERVE_OR_DELEGATE(in.device(), SIZE_MAX, own_alltoall_base(out, in, os, is, o),  // sizes may differ
                        alltoall_base(out, in, os, is, o));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::alltoall(std::vector<at::Tensor>& out,
                                                    std::vector<at::Tensor>& in,
                                                    const c10d::AllToAllOptions& o) {
  ODC_SERVE_OR_DELEGATE(device_of(in), SIZE_MAX, own_alltoall(out, in, o), alltoall(out, in, o));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::send(std::vector<at::Tensor>& t, int dst, int tag) {
  ODC_DELEGATE(device_of(t).type(), send(t, dst, tag));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::recv(std::vector<at::Tensor>& t, int src, int tag) {
  ODC_DELEGATE(device_of(t).type(), recv(t, src, tag));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::recvAnysource(std::vector<at::Tensor>& t, int tag) {
  ODC_DELEGATE(device_of(t).type(), recvAnysource(t, tag));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::barrier(const c10d::BarrierOptions& o) {
  // A host barrier (the CPU inner backend) unless a CUDA device is named; then the barrier
  // also orders device work, as NCCL's does. A build without CUDA has no CUDA side: its
  // barrier is a host barrier whatever device_ids say (what gloo does).
  if (kBuiltWithCuda && ((o.device && o.device->is_cuda()) || !o.device_ids.empty())) {
    const c10::Device device =
        o.device && o.device->is_cuda()
            ? *o.device
            : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(o.device_ids[0]));
    if (serves_itself(device, 0)) return own_barrier(device);
    ODC_DELEGATE(c10::kCUDA, barrier(o));
  }
  if (serves_itself(c10::Device(c10::kCPU), 0)) return own_barrier(c10::Device(c10::kCPU));
  ODC_DELEGATE(c10::kCPU, barrier(o));
}

#undef ODC_SERVE_OR_DELEGATE
#undef ODC_DELEGATE

}  // namespace odc
