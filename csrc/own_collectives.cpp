// Layer 5, backend (backend.hpp).
//
// The collectives odc serves itself instead of its inner gloo / NCCL backend: where that
// backend cannot (ranks sharing a GPU, which NCCL refuses; a torch without NCCL), where they
// are small (serves_itself: no NCCL group is made for a scalar), or everywhere with
// ODC_SELF_SERVE=1. All of them run on odc's own rings:
//   all-reduce   a reduce-scatter then an all-gather (deterministic, in rank order)
//   reduce       an all-reduce (non-roots reduce a copy: their tensors stay as they were)
//   broadcast    a get from the root's all-gather ring
//   all-gather   an all-gather into one buffer (uneven sizes: one broadcast per rank)
//   all-to-all, scatter, gather   Protocol::exchange over the landing rings
//   barrier      a one-element all-reduce that the host waits for
// Send / recv are not served: they stay with the inner backend.
#include "backend.hpp"
#include "device_work.hpp"

#include <ATen/ATen.h>

#include "text.hpp"

#ifdef ODC_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace odc {
namespace {

// Byte counts and offsets of a list of tensors laid end to end.
struct Layout {
  std::vector<size_t> bytes, off;
  size_t total = 0;
};

Layout lay_out(const std::vector<at::Tensor>& ts) {
  Layout l;
  for (const auto& t : ts) {
    l.off.push_back(l.total);
    l.bytes.push_back(t.numel() * t.element_size());
    l.total += l.bytes.back();
  }
  return l;
}

// The tensors' bytes as one flat byte tensor (a copy, on the current stream).
at::Tensor concat_bytes(const std::vector<at::Tensor>& ts, const c10::Device& device) {
  std::vector<at::Tensor> flat;
  for (const auto& t : ts) flat.push_back(t.reshape(-1).view(at::kByte));
  return flat.empty() ? at::empty({0}, at::TensorOptions().dtype(at::kByte).device(device))
                      : at::cat(flat);
}

void split_bytes(const at::Tensor& flat, const Layout& l, std::vector<at::Tensor>& ts) {
  for (size_t i = 0; i < ts.size(); ++i) {
    ts[i].view(-1).view(at::kByte).copy_(flat.narrow(0, l.off[i], l.bytes[i]));
  }
}

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* api) {
  ODC_CHECK(a.scalar_type() == b.scalar_type(), TypeError, "odc: ", api, ": dtypes differ (",
            c10::toString(a.scalar_type()), " vs ", c10::toString(b.scalar_type()), ")");
}

}  // namespace

bool OdcBackend::serves_itself(const c10::Device& device, size_t bytes) {
  if (options_->self_serve == SelfServe::Odc) return true;
  if (options_->self_serve == SelfServe::Inner || !device.is_cuda()) return false;
  if (!options_->nccl_available) return true;
  // Under CUDA graph capture odc cannot serve (its collectives refuse capture): NCCL serves
  // where the group is set up and its ranks do not share GPUs. Where it is not set up yet (its
  // set-up cannot run in a capture) or ranks share GPUs, odc takes it and names the problem.
  // Every rank decides alike: they capture the same region.
  const bool capturing = stream_is_capturing(device);
  {
    std::lock_guard<std::mutex> lock(mu_);
    check_usable();
    if (!capturing) {
      const Channel& ch = channel(device);  // sets the transport up (collective) the first time
      if (!ch.hosts.empty()) return false;  // across hosts: NCCL, whose ranks never share
      // Sharing is a fact of the group, and `bytes` is the same on every rank (delegated.cpp).
      if (ch.shares_device) return true;
      return ch.own_gpus && bytes <= kSelfServeBytes;
    }
    auto it = channels_.find(device.type());
    if (it == channels_.end() || it->second.shares_device) return true;
  }
  // Captured, for NCCL: its communicator must exist already (NCCL cannot set one up inside a
  // capture), which it does not where odc served every collective until now.
  {
    std::lock_guard<std::mutex> lock(inner_mu_);  // not under mu_: inner() takes inner_mu_ first
    if (inners_.count(c10::kCUDA)) return false;
  }
  C10_THROW_ERROR(Error, cat(
      "odc: a collective captured in a CUDA graph on group '", options_->group_name,
      "' goes to its inner NCCL group, which has not run a collective yet, and NCCL cannot set up ",
      "its communicator inside a capture. Run one such collective before capturing: with ",
      "ODC_SELF_SERVE=auto odc serves those of up to ", kSelfServeBytes >> 20, " MiB per rank ",
      "itself, so run a larger one (or any with ODC_SELF_SERVE=0, which sends them all to NCCL)"));
}

void OdcBackend::own_all_reduce(Channel& ch, void* stream, uint64_t seq, const at::Tensor& t,
                                const ReduceSpec& spec, uint64_t rs_desc, uint64_t ag_desc) {
  const int world = getSize();
  const int64_t n = t.numel();
  const int64_t part = (n + world - 1) / world;
  // Its memory's elements, in memory order (a dense tensor's strides may be any: channels-last)
  const at::Tensor flat = t.is_contiguous() ? t.view(-1) : t.as_strided({n}, {1});
  // Pad to world equal parts: the padding is reduced with itself and dropped.
  const bool padded = part * world != n;
  at::Tensor buf = padded ? at::empty({part * world}, t.options()) : flat;
  if (padded) buf.narrow(0, 0, n).copy_(flat);
  at::Tensor mine = at::empty({part}, t.options());
  const size_t elem = t.element_size();
  ch.protocol->operation(stream, Ring::kReduceScatter, [&] {
    ch.protocol->reduce_scatter(mine.data_ptr(), buf.data_ptr(), part, elem, spec, seq, rs_desc);
  });
  ch.protocol->operation(stream, Ring::kAllGather, [&] {
    ch.protocol->all_gather(buf.data_ptr(), mine.data_ptr(), part * elem, seq, ag_desc);
  });
  if (padded) flat.copy_(buf.narrow(0, 0, n));
}

c10::intrusive_ptr<c10d::Work> OdcBackend::own_allreduce(std::vector<at::Tensor>& tensors,
                                                         const c10d::ReduceOp& op, bool async_op,
                                                         const char* api) {
  ODC_CHECK(!tensors.empty(), ValueError, "odc: ", api, ": no tensors");
  const c10::Device device = tensors[0].device();
  std::vector<at::Tensor> keep(tensors.begin(), tensors.end());
  std::vector<ReduceSpec> specs;
  std::vector<RedOp> ops;
  for (const auto& t : tensors) {
    check_tensor(t, device, api, "tensor", /*dense=*/true);
    RedOp r;
    specs.push_back(reduce_spec(t, op, api, keep, &r));
    ops.push_back(r);
  }
  return launch(device, async_op, c10d::OpType::ALLREDUCE, tensors, std::move(keep),
                [&](Channel& ch, void* stream, uint64_t seq) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      const at::Tensor& t = tensors[i];
      const uint64_t bytes = t.numel() * t.element_size();
      own_all_reduce(ch, stream, seq, t, specs[i], desc(OpKind::AllReduce, t, bytes, ops[i], true),
                     desc(OpKind::AllReduce, t, bytes));
      count(Stat::OwnAllReduceOps, 1);
    }
  });
}

c10::intrusive_ptr<c10d::Work> OdcBackend::own_reduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::ReduceOptions& opts) {
  const char* api = "reduce";
  ODC_CHECK(tensors.size() == 1, ValueError, "odc: ", api, ": one tensor expected");
  const at::Tensor& t = tensors[0];
  check_tensor(t, t.device(), api, "tensor", /*dense=*/true);
  std::vector<at::Tensor> keep{t};
  RedOp r;
  const ReduceSpec spec = reduce_spec(t, opts.reduceOp, api, keep, &r);
  const bool root = static_cast<int>(opts.rootRank) == getRank();
  return launch(t.device(), opts.asyncOp, c10d::OpType::REDUCE, tensors, std::move(keep),
                [&](Channel& ch, void* stream, uint64_t seq) {
    const at::Tensor work = root ? t : t.clone();  // non-roots keep their input
    const uint64_t bytes = t.numel() * t.element_size();
    own_all_reduce(ch, stream, seq, work, spec, desc(OpKind::AllReduce, t, bytes, r, true),
                   desc(OpKind::AllReduce, t, bytes));
    count(Stat::OwnReduceOps, 1);
  });
}

c10::intrusive_ptr<c10d::Work> OdcBackend::own_broadcast(std::vector<at::Tensor>& tensors,
                                                         const c10d::BroadcastOptions& opts) {
  const char* api = "broadcast";
  ODC_CHECK(tensors.size() == 1, ValueError, "odc: ", api, ": one tensor expected");
  const at::Tensor& t = tensors[0];
  check_tensor(t, t.device(), api, "tensor", /*dense=*/true);
  const int root = static_cast<int>(opts.rootRank);
  ODC_CHECK(root >= 0 && root < getSize(), ValueError, "odc: ", api, ": root ", root,
            " is not a rank of this group");
  return launch(t.device(), opts.asyncOp, c10d::OpType::BROADCAST, tensors, tensors,
                [&](Channel& ch, void* stream, uint64_t seq) {
    const uint64_t bytes = t.numel() * t.element_size();
    ch.protocol->operation(stream, Ring::kAllGather, [&] {
      ch.protocol->broadcast(t.data_ptr(), bytes, root, seq,
                             desc(OpKind::Broadcast, t, bytes, RedOp::Sum, false, root));
    });
    count(Stat::OwnBroadcastOps, 1);
  });
}

c10::intrusive_ptr<c10d::Work> OdcBackend::own_allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const char* api = "all_gather";
  ODC_CHECK(inputs.size() == 1 && outputs.size() == 1 &&
                static_cast<int>(outputs[0].size()) == getSize(),
            ValueError, "odc: ", api, ": one input and a list of world-size outputs expected");
  const at::Tensor& in = inputs[0];
  std::vector<at::Tensor>& outs = outputs[0];
  check_tensor(in, in.device(), api, "input");
  bool even = true;
  for (const auto& o : outs) {
    check_tensor(o, in.device(), api, "output");
    check_same_dtype(in, o, api);
    even = even && o.numel() == in.numel();
  }
  ODC_CHECK(outs[getRank()].numel() == in.numel(), ValueError, "odc: ", api, ": this rank's ",
            "output has ", outs[getRank()].numel(), " elements, its input ", in.numel());
  return launch(in.device(), opts.asyncOp, c10d::OpType::ALLGATHER, outs, inputs,
                [&](Channel& ch, void* stream, uint64_t seq) {
    const uint64_t bytes = in.numel() * in.element_size();
    if (even) {  // one all-gather, then into the list
      at::Tensor flat = at::empty({getSize() * in.numel()}, in.options());
      ch.protocol->operation(stream, Ring::kAllGather, [&] {
        ch.protocol->all_gather(flat.data_ptr(), in.data_ptr(), bytes, seq,
                                desc(OpKind::AllGather, in, bytes));
      });
      for (int r = 0; r < getSize(); ++r) {
        outs[r].view(-1).copy_(flat.narrow(0, r * in.numel(), in.numel()));
      }
    } else {  // sizes differ by rank: each rank's tensor broadcast from it
      outs[getRank()].view(-1).copy_(in.view(-1));
      for (int r = 0; r < getSize(); ++r) {
        const uint64_t b = outs[r].numel() * outs[r].element_size();
        ch.protocol->operation(stream, Ring::kAllGather, [&] {
          ch.protocol->broadcast(outs[r].data_ptr(), b, r, seq,
                                 desc(OpKind::Broadcast, outs[r], b, RedOp::Sum, false, r));
        });
      }
    }
    count(Stat::OwnAllGatherOps, 1);
  });
}

c10::intrusive_ptr<c10d::Work> OdcBackend::own_reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const char* api = "reduce_scatter";
  ODC_CHECK(outputs.size() == 1 && inputs.size() == 1 &&
                static_cast<int>(inputs[0].size()) == getSize(),
            ValueError, "odc: ", api, ": one output and a list of world-size inputs expected");
  const at::Tensor& out = outputs[0];
  check_tensor(out, out.device(), api, "output");
  for (const auto& t : inputs[0]) {
    check_tensor(t, out.device(), api, "input");
    check_same_dtype(out, t, api);
    ODC_CHECK(t.numel() == out.numel(), ValueError, "odc: ", api, ": every input must have the "
              "output's ", out.numel(), " elements, got ", t.numel());
  }
  std::vector<at::Tensor> keep(inputs[0].begin(), inputs[0].end());
  RedOp r;
  const ReduceSpec spec = reduce_spec(out, opts.reduceOp, api, keep, &r);
  return launch(out.device(), opts.asyncOp, c10d::OpType::REDUCE_SCATTER, outputs,
                std::move(keep), [&](Channel& ch, void* stream, uint64_t seq) {
    std::vector<at::Tensor> flat;
    for (const auto& t : inputs[0]) flat.push_back(t.view(-1));
    const at::Tensor in = at::cat(flat);
    const uint64_t bytes = out.numel() * out.element_size();
    ch.protocol->operation(stream, Ring::kReduceScatter, [&] {
      ch.protocol->reduce_scatter(out.data_ptr(), in.data_ptr(), out.numel(), out.element_size(),
                                  spec, seq, desc(OpKind::ReduceScatter, out, bytes, r, true));
    });
    count(Stat::OwnReduceScatterOps, 1);
  });
}

c10::intrusive_ptr<c10d::Work> OdcBackend::own_exchange(at::Tensor& output,
                                                        const at::Tensor& input,
                                                        Protocol::Exchange x, bool async_op,
                                                        c10d::OpType type, const char* api) {
  x.check = options_->match_check;
  std::vector<at::Tensor> outs{output};
  return launch(output.device(), async_op, type, outs, {input},
                [&](Channel& ch, void* stream, uint64_t seq) {
    ch.protocol->operation(stream, Ring::kReduceScatter, [&] {
      ch.protocol->exchange(output.data_ptr(), input.data_ptr(), x, seq);
    });
    count(Stat::OwnExchangeOps, 1);
  });
}

c10::intrusive_ptr<c10d::Work> OdcBackend::own_alltoall_base(at::Tensor& output, at::Tensor& input,
                                                             std::vector<int64_t>& out_splits,
                                                             std::vector<int64_t>& in_splits,
                                                             const c10d::AllToAllOptions& opts) {
  const char* api = "all_to_all_single";
  const int world = getSize();
  check_tensor(input, input.device(), api, "input");
  check_tensor(output, input.device(), api, "output");
  check_same_dtype(input, output, api);
  // Rows (dim 0) per rank: the splits, or equal parts.
  auto bytes_of = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* what) {
    const int64_t rows = t.dim() ? t.size(0) : 1;
    const int64_t row_bytes = rows ? t.numel() * t.element_size() / rows : 0;
    std::vector<size_t> bytes(world), off(world);
    if (splits.empty()) {
      ODC_CHECK(rows % world == 0, ValueError, "odc: ", api, ": the ", what, "'s ", rows,
                " rows do not split into ", world, " equal parts; pass split sizes");
    } else {
      ODC_CHECK(static_cast<int>(splits.size()) == world, ValueError, "odc: ", api, ": ", what,
                " split sizes must have one entry per rank");
    }
    int64_t total = 0;
    for (int p = 0; p < world; ++p) {
      const int64_t r = splits.empty() ? rows / world : splits[p];
      off[p] = total * row_bytes;
      bytes[p] = r * row_bytes;
      total += r;
    }
    ODC_CHECK(total == rows, ValueError, "odc: ", api, ": ", what, " split sizes add up to ", total,
              " rows, the ", what, " has ", rows);
    return std::make_pair(bytes, off);
  };
  Protocol::Exchange x;
  std::tie(x.send, x.send_off) = bytes_of(input, in_splits, "input");
  std::tie(x.recv, x.recv_off) = bytes_of(output, out_splits, "output");
  ODC_CHECK(x.send[getRank()] == x.recv[getRank()], ValueError, "odc: ", api,
            ": this rank sends itself ", x.send[getRank()], " bytes but receives ",
            x.recv[getRank()]);
  x.kind = OpKind::AllToAll;
  x.scalar_type = static_cast<int>(input.scalar_type());
  x.talk_empty = true;
  return own_exchange(output, input, x, opts.asyncOp, c10d::OpType::ALLTOALL_BASE, api);
}

c10::intrusive_ptr<c10d::Work> OdcBackend::own_alltoall(std::vector<at::Tensor>& outputs,
                                                        std::vector<at::Tensor>& inputs,
                                                        const c10d::AllToAllOptions& opts) {
  const char* api = "all_to_all";
  const int world = getSize();
  ODC_CHECK(static_cast<int>(inputs.size()) == world && static_cast<int>(outputs.size()) == world,
            ValueError, "odc: ", api, ": one input and one output per rank expected");
  const c10::Device device = inputs[0].device();
  for (int p = 0; p < world; ++p) {
    check_tensor(inputs[p], device, api, "input");
    check_tensor(outputs[p], device, api, "output");
    check_same_dtype(inputs[0], inputs[p], api);
    check_same_dtype(inputs[0], outputs[p], api);
  }
  const Layout in_l = lay_out(inputs), out_l = lay_out(outputs);
  ODC_CHECK(in_l.bytes[getRank()] == out_l.bytes[getRank()], ValueError, "odc: ", api,
            ": this rank's input and output for itself differ in size");
  Protocol::Exchange x;
  x.send = in_l.bytes;
  x.send_off = in_l.off;
  x.recv = out_l.bytes;
  x.recv_off = out_l.off;
  x.kind = OpKind::AllToAll;
  x.scalar_type = static_cast<int>(inputs[0].scalar_type());
  x.check = options_->match_check;
  x.talk_empty = true;
  std::vector<at::Tensor> keep(inputs.begin(), inputs.end());
  return launch(device, opts.asyncOp, c10d::OpType::ALLTOALL, outputs, std::move(keep),
                [&](Channel& ch, void* stream, uint64_t seq) {
    const at::Tensor in = concat_bytes(inputs, device);
    at::Tensor out = at::empty({static_cast<int64_t>(out_l.total)},
                               at::TensorOptions().dtype(at::kByte).device(device));
    ch.protocol->operation(stream, Ring::kReduceScatter, [&] {
      ch.protocol->exchange(out.data_ptr(), in.data_ptr(), x, seq);
    });
    split_bytes(out, out_l, outputs);
    count(Stat::OwnExchangeOps, 1);
  });
}

c10::intrusive_ptr<c10d::Work> OdcBackend::own_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  const char* api = "scatter";
  const int world = getSize(), root = static_cast<int>(opts.rootRank);
  const bool is_root = root == getRank();
  ODC_CHECK(outputs.size() == 1, ValueError, "odc: ", api, ": one output expected");
  ODC_CHECK(!is_root || (inputs.size() == 1 && static_cast<int>(inputs[0].size()) == world),
            ValueError, "odc: ", api, ": the root needs one input per rank");
  at::Tensor& out = outputs[0];
  check_tensor(out, out.device(), api, "output");
  Protocol::Exchange x;
  x.send.assign(world, 0);
  x.send_off.assign(world, 0);
  x.recv.assign(world, 0);
  x.recv_off.assign(world, 0);
  x.recv[root] = out.numel() * out.element_size();
  std::vector<at::Tensor> root_inputs = is_root ? inputs[0] : std::vector<at::Tensor>{};
  for (const auto& t : root_inputs) {
    check_tensor(t, out.device(), api, "input");
    check_same_dtype(out, t, api);
  }
  const Layout l = lay_out(root_inputs);
  if (is_root) {
    x.send = l.bytes;
    x.send_off = l.off;
  }
  x.kind = OpKind::Scatter;
  x.scalar_type = static_cast<int>(out.scalar_type());
  x.root = root;
  x.check = options_->match_check;
  std::vector<at::Tensor> keep = root_inputs;
  return launch(out.device(), opts.asyncOp, c10d::OpType::SCATTER, outputs, std::move(keep),
                [&](Channel& ch, void* stream, uint64_t seq) {
    const at::Tensor in = concat_bytes(root_inputs, out.device());
    ch.protocol->operation(stream, Ring::kReduceScatter, [&] {
      ch.protocol->exchange(out.data_ptr(), in.data_ptr(), x, seq);
    });
    count(Stat::OwnExchangeOps, 1);
  });
}

c10::intrusive_ptr<c10d::Work> OdcBackend::own_gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  const char* api = "gather";
  const int world = getSize(), root = static_cast<int>(opts.rootRank);
  const bool is_root = root == getRank();
  ODC_CHECK(inputs.size() == 1, ValueError, "odc: ", api, ": one input expected");
  ODC_CHECK(!is_root || (outputs.size() == 1 && static_cast<int>(outputs[0].size()) == world),
            ValueError, "odc: ", api, ": the root needs one output per rank");
  const at::Tensor& in = inputs[0];
  check_tensor(in, in.device(), api, "input");
  std::vector<at::Tensor> root_outputs = is_root ? outputs[0] : std::vector<at::Tensor>{};
  for (const auto& t : root_outputs) {
    check_tensor(t, in.device(), api, "output");
    check_same_dtype(in, t, api);
  }
  const Layout l = lay_out(root_outputs);
  Protocol::Exchange x;
  x.send.assign(world, 0);
  x.send_off.assign(world, 0);
  x.recv.assign(world, 0);
  x.recv_off.assign(world, 0);
  x.send[root] = in.numel() * in.element_size();
  if (is_root) {
    x.recv = l.bytes;
    x.recv_off = l.off;
  }
  x.kind = OpKind::Gather;
  x.scalar_type = static_cast<int>(in.scalar_type());
  x.root = root;
  x.check = options_->match_check;
  return launch(in.device(), opts.asyncOp, c10d::OpType::GATHER, root_outputs, inputs,
                [&](Channel& ch, void* stream, uint64_t seq) {
    at::Tensor out = at::empty({static_cast<int64_t>(l.total)},
                               at::TensorOptions().dtype(at::kByte).device(in.device()));
    ch.protocol->operation(stream, Ring::kReduceScatter, [&] {
      ch.protocol->exchange(out.data_ptr(), in.data_ptr(), x, seq);
    });
    split_bytes(out, l, root_outputs);
    count(Stat::OwnExchangeOps, 1);
  });
}

c10::intrusive_ptr<c10d::Work> OdcBackend::own_barrier(const c10::Device& device) {
  at::Tensor one = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(device));
  std::vector<at::Tensor> ts{one};
  ReduceSpec spec;
  spec.dtype = DType::I32;
  return launch(device, false, c10d::OpType::BARRIER, {}, ts,
                [&](Channel& ch, void* stream, uint64_t seq) {
    const uint64_t d = desc(OpKind::AllReduce, one, sizeof(int32_t), RedOp::Sum, true);
    own_all_reduce(ch, stream, seq, one, spec, d, desc(OpKind::AllReduce, one, sizeof(int32_t)));
    count(Stat::OwnBarrierOps, 1);
  }, /*blocking=*/true);
}

}  // namespace odc
