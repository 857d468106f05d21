// Layer 5, backend: OdcBackend (backend.hpp): argument checks, launching collectives on a
// channel, delegation to the inner backends, the store-based claims of odc.balance.
#include "backend.hpp"

#include <ATen/core/ivalue.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/exception.h>

#include <algorithm>
#include <exception>  // std::uncaught_exceptions
#include <mutex>
#include <cstdio>
#include <cstring>

#include "device_work.hpp"
#include "text.hpp"
#include "work.hpp"

namespace odc {
DType to_dtype(at::ScalarType t, const char* api) {
  switch (t) {
    case at::kFloat: return DType::F32;
    case at::kBFloat16: return DType::BF16;
    case at::kHalf: return DType::F16;
    case at::kDouble: return DType::F64;
    case at::kInt: return DType::I32;
    case at::kLong: return DType::I64;
    case at::kByte:
    case at::kBool: return DType::U8;
    case at::kChar: return DType::I8;
    default:
      C10_THROW_ERROR(TypeError, cat("odc: ", api, ": unsupported dtype ", c10::toString(t),
                                     " (reductions support float32, bfloat16, float16, float64, "
                                     "int32, int64, uint8, int8 and bool)"));
  }
}

std::string describe(const at::Tensor& t) {
  std::string dims;
  for (int64_t d : t.sizes()) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
  return cat(c10::toString(t.scalar_type()), "[", dims, "] on ", t.device());
}


OdcBackend::OdcBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                       c10::intrusive_ptr<odc::Options> options, InnerFactory inner,
                       SplitFactory split_factory)
    : Backend(rank, size),
      store_(std::move(store)),
      options_(options ? std::move(options) : odc::Options::create()),
      timeout_ms_(std::make_shared<std::atomic<int64_t>>(options_->timeout.count())),
      inner_factory_(std::move(inner)),
      split_factory_(std::move(split_factory)) {
  ODC_CHECK(options_->global_ranks_in_group.empty() ||
                options_->global_ranks_in_group.size() == static_cast<size_t>(size),
            ValueError, "odc: options.global_ranks_in_group names ",
            options_->global_ranks_in_group.size(), " ranks for a group of ", size);
  if (options_->global_ranks_in_group.empty()) {  // the default group: global rank = group rank
    for (int r = 0; r < size; ++r) options_->global_ranks_in_group.push_back(r);
  }
}

void OdcBackend::setTimeout(std::chrono::milliseconds timeout) {
  options_->timeout = timeout;
  timeout_ms_->store(timeout.count(), std::memory_order_relaxed);  // the transports' waits
  std::lock_guard<std::mutex> lock(inner_mu_);
  for (auto& [type, inner] : inners_) inner->setTimeout(timeout);  // the delegated collectives
}

OdcBackend::~OdcBackend() {
  for (auto& [type, ch] : channels_) release_device(ch);
}

c10::intrusive_ptr<c10d::Backend::Options> OdcBackend::getBackendOptions() {
  return options_->clone();  // a copy: c10d's split sets its group name on what it gets
}

std::vector<int> OdcBackend::global_ranks() const {
  const auto& g = options_->global_ranks_in_group;
  return std::vector<int>(g.begin(), g.end());
}

void OdcBackend::eagerConnectSingleDevice(at::Device device) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  channel(device);
}

c10::intrusive_ptr<c10d::Backend> OdcBackend::split(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const std::vector<int>& ranks,
                                                    const c10::intrusive_ptr<Options>& opts) {
  for (size_t i = 0; i < ranks.size(); ++i) {
    ODC_CHECK(ranks[i] >= 0 && ranks[i] < getSize() && (i == 0 || ranks[i] > ranks[i - 1]),
              ValueError, "odc: split: ranks must be distinct ranks of the group (0..",
              getSize() - 1, "), in ascending order");
  }
  const auto me = std::find(ranks.begin(), ranks.end(), getRank());
  if (me == ranks.end()) return nullptr;
  ODC_CHECK(split_factory_, Error, "odc: split: this backend was made without a split factory");
  const std::vector<int> parent = global_ranks();
  std::vector<int> global;
  for (int r : ranks) global.push_back(parent[r]);
  // The new group's options: odc options handed back (c10d's copy of getBackendOptions, or
  // the caller's), else this group's; then the new group's name, ranks and timeout.
  const auto* given = dynamic_cast<const odc::Options*>(opts.get());
  c10::intrusive_ptr<odc::Options> o = given ? given->clone() : options_->clone();
  o->group_name = opts && !opts->group_name.empty() ? opts->group_name
                                                     : options_->group_name + ":split";
  o->global_ranks_in_group.assign(global.begin(), global.end());
  o->timeout = opts ? opts->timeout : options_->timeout;
  // The new group's keys live apart from those of other backends split with it (gloo).
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("odc/", store);
  return split_factory_(prefixed, static_cast<int>(me - ranks.begin()),
                        static_cast<int>(ranks.size()), o);
}

void OdcBackend::release_inners(bool abort) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_.empty()) broken_ = "the group was shut down";
  }
  std::map<c10::DeviceType, c10::intrusive_ptr<c10d::Backend>> inners;
  {
    std::lock_guard<std::mutex> lock(inner_mu_);
    inners.swap(inners_);
  }
  for (auto& [type, b] : inners) abort ? b->abort() : b->shutdown();
  // Dropping the last references here joins the inner backends' threads.
}

void OdcBackend::shutdown() { release_inners(false); }
void OdcBackend::abort() { release_inners(true); }

void OdcBackend::settle_default_backend_type() {
  // Only getters that cannot fail: a failing TORCH_CHECK in a torch header compiled into
  // this library formats its message with this library's iostreams (Limitations: crashes).
  std::call_once(default_type_once_, [this] {
    using Type = c10d::ProcessGroup::BackendType;
    c10::intrusive_ptr<c10d::ProcessGroup> pg;
    try {
      pg = c10d::resolve_process_group(getGroupUid());
    } catch (const std::exception&) {
      return;  // not a registered group (e.g. a backend made by hand): nothing to settle
    }
    const Type type = pg->getBackendType();
    if (type == Type::CUSTOM) return;
    bool present = false;  // does some device type of the group use the default type's backend?
    if (type == Type::GLOO || type == Type::NCCL) {
      const std::string name = type == Type::GLOO ? "gloo" : "nccl";
      for (const c10::Device& d : pg->getDeviceTypes()) {
        present = present || pg->getBackend(d.type())->getBackendName() == name;
      }
    }
    if (!present) pg->setDefaultBackend(Type::CUSTOM);
  });
}

void OdcBackend::check_usable() {
  ODC_CHECK(broken_.empty(), Error, "odc: group '", options_->group_name,
              "' is unusable after an earlier communication error: ", broken_);
}

Channel& OdcBackend::channel(const c10::Device& device) {
  auto it = channels_.find(device.type());
  if (it != channels_.end()) {
    ODC_CHECK(it->second.device == device, ValueError, "odc: group '", options_->group_name,
                      "' moves data on ", it->second.device, " but got a tensor on ", device,
                      "; use one device per process (torch.cuda.set_device)");
    return it->second;
  }
  Channel ch = make_channel(device, *options_, timeout_ms_, store_, getRank(), getSize());
  return channels_.emplace(device.type(), std::move(ch)).first->second;
}

bool OdcBackend::registered_inputs(Channel& ch, bool ag, const at::Tensor& in,
                                   const at::Tensor& out, size_t per_rank,
                                   std::vector<const char*>* in_at, RegisteredId* id) const {
  // Only the buffers FSDP2 allocates for its collectives qualify, so that every rank takes
  // the same path: an all-gather in place (its output a whole registered buffer, its input
  // this rank's part of it), a reduce-scatter whose input is a whole registered buffer.
  // Other tensors in registered memory (views of it, such as FSDP2's gradients) take the
  // staged path: whether a view is registered can differ between ranks.
  const RegisteredPool* pool = ch.pool.get();
  const int rank = getRank(), world = getSize();
  const size_t whole = per_rank * world;
  size_t off = 0;
  if (!pool || whole == 0) return false;
  if (ag) {
    if (static_cast<const char*>(in.data_ptr()) !=
            static_cast<const char*>(out.data_ptr()) + static_cast<size_t>(rank) * per_rank ||
        !pool->is_block(out.data_ptr(), whole, &off)) {
      return false;
    }
  } else if (!pool->is_block(in.data_ptr(), whole, &off)) {
    return false;
  }
  id->offset = off;
  in_at->clear();
  for (int r = 0; r < world; ++r) {
    in_at->push_back(pool->base(r) + off + (ag ? static_cast<size_t>(r) * per_rank : 0));
  }
  return true;
}

at::Tensor OdcBackend::allocateTensor(long size, at::TensorOptions options) {
  const c10::Device device = options.device();
  ODC_CHECK(size >= 0, ValueError, "odc: allocate_tensor: negative size ", size);
  ODC_CHECK(device.is_cpu() || device.is_cuda(), ValueError,
            "odc: allocate_tensor: unsupported device ", device);
  settle_default_backend_type();
  std::shared_ptr<RegisteredPool> pool;
  {
    std::lock_guard<std::mutex> lock(mu_);
    check_usable();
    Channel& ch = channel(device);
    if (!ch.pool && ch.transport && ch.transport->maps_every_peer()) {
      const size_t bytes = options_->pool_bytes_for(device.is_cuda());
      int arena = 0;
      try {
        arena = ch.transport->create_arena(bytes);  // collective
      } catch (const std::exception& e) {
        C10_THROW_ERROR(DistBackendError,
                        cat("odc: allocate_tensor: registered memory is set up by every rank of "
                            "the group at its first allocate_tensor, and one did not take part: ",
                            e.what()));
      }
      std::vector<char*> bases;
      for (int r = 0; r < getSize(); ++r) bases.push_back(ch.transport->arena(arena, r));
      ch.pool = std::make_shared<RegisteredPool>(std::move(bases), bytes, getRank(),
                                                 stream_order(device));
    }
    pool = ch.pool;
  }
  const size_t bytes = static_cast<size_t>(size) * options.dtype().itemsize();
  const size_t off = pool ? pool->allocate(bytes) : SIZE_MAX;
  if (off == SIZE_MAX) {  // full (or no pool): ordinary memory, the staged path
    count(Stat::RegisteredFallbacks, 1);
    return at::empty({size}, options);
  }
  count(Stat::RegisteredAllocations, 1);
  return at::from_blob(pool->base(getRank()) + off, {size},
                       [pool, off](void*) { pool->free(off); }, options);
}

void check_tensor(const at::Tensor& t, const c10::Device& device, const char* api,
                  const char* what) {
  ODC_CHECK(t.defined(), ValueError, "odc: ", api, ": undefined ", what);
  ODC_CHECK(t.device() == device, ValueError, "odc: ", api, ": all tensors must be on one device, ",
            "got ", what, " ", describe(t), " and others on ", device);
  ODC_CHECK(device.is_cpu() || device.is_cuda(), ValueError, "odc: ", api,
            ": unsupported device ", device);
  ODC_CHECK(t.is_contiguous(), ValueError, "odc: ", api, ": tensors must be contiguous (", what,
            " ", describe(t), " is not); call .contiguous() first");
}

const char* reduce_op_name(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNUSED";
  }
}

bool is_bitwise(const c10d::ReduceOp& op) {
  return op.op_ == c10d::ReduceOp::BAND || op.op_ == c10d::ReduceOp::BOR ||
         op.op_ == c10d::ReduceOp::BXOR;
}

ReduceSpec OdcBackend::reduce_spec(const at::Tensor& t, const c10d::ReduceOp& op, const char* api,
                                   std::vector<at::Tensor>& factors, RedOp* red_op) {
  ReduceSpec spec;
  spec.dtype = to_dtype(t.scalar_type(), api);
  const bool floating = at::isFloatingType(t.scalar_type());
  const bool boolean = t.scalar_type() == at::kBool;
  *red_op = RedOp::Sum;
  switch (op.op_) {
    case c10d::ReduceOp::SUM:  // of booleans: a logical or, as NCCL's
      spec.combine = boolean ? Combine::Max : Combine::Sum;
      break;
    case c10d::ReduceOp::AVG:
      ODC_CHECK(floating, TypeError, "odc: ", api, ": AVG needs a floating-point dtype, got ",
                c10::toString(t.scalar_type()));
      spec.scale = 1.0 / getSize();
      *red_op = RedOp::Avg;
      break;
    case c10d::ReduceOp::PREMUL_SUM: {
      ODC_CHECK(floating, TypeError, "odc: ", api, ": PREMUL_SUM needs a floating-point dtype");
      *red_op = RedOp::PreMulSum;
      auto* sup = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      ODC_CHECK(sup, ValueError, "odc: ", api, ": PREMUL_SUM without a factor");
      if (sup->tensor_factor.defined()) {
        factors.push_back(sup->tensor_factor.to(t.device(), at::kFloat).contiguous());
        spec.scale_ptr = factors.back().data_ptr<float>();
      } else {
        spec.scale = sup->double_factor;
      }
      break;
    }
    case c10d::ReduceOp::MAX: spec.combine = Combine::Max; *red_op = RedOp::Max; break;
    case c10d::ReduceOp::MIN: spec.combine = Combine::Min; *red_op = RedOp::Min; break;
    case c10d::ReduceOp::PRODUCT:  // of booleans: a logical and
      spec.combine = boolean ? Combine::Min : Combine::Product;
      *red_op = RedOp::Product;
      break;
    default:
      ODC_CHECK(false, ValueError, "odc: ", api, ": unsupported reduce op ", reduce_op_name(op),
                " (odc reduces with SUM, AVG, PREMUL_SUM, MAX, MIN and PRODUCT; with "
                "ODC_SELF_SERVE=0 the collectives FSDP does not issue, bitwise ones included, go "
                "to the inner gloo / NCCL backend)");
  }
  return spec;
}

uint64_t OdcBackend::desc(OpKind kind, const at::Tensor& t, uint64_t bytes, RedOp op,
                          bool reduces, int root) const {
  return options_->match_check ? op_desc(kind, static_cast<int>(t.scalar_type()), bytes,
                                      reduces ? 1 + static_cast<int>(op) : 0, root)
                            : 0;
}

c10::intrusive_ptr<c10d::Work> OdcBackend::launch(const c10::Device& device, bool async_op,
                                                  c10d::OpType type, std::vector<at::Tensor> outputs,
                                                  std::vector<at::Tensor> keep, const Body& body,
                                                  bool blocking, bool ends_with_op) {
  settle_default_backend_type();
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  Channel& ch = channel(device);
  ODC_CHECK(ch.transport, ValueError, cross_host_refusal(ch, *options_, c10d::opTypeToString(type)));
  {
    const std::string err = ch.transport->async_error();
    if (!err.empty()) {
      broken_ = err;
      C10_THROW_ERROR(DistBackendError, err);
    }
  }
  const uint64_t seq = ++seq_;
  const std::unique_ptr<DeviceLaunch> on_device = begin_launch(ch, async_op);
  void* stream = on_device->stream();
  try {
    // One collective of the group: numbered and announced to the peers (protocol.hpp).
    struct Bracket {
      Protocol& p;
      const int unwinding = std::uncaught_exceptions();
      explicit Bracket(Protocol& p) : p(p) { p.begin_collective(); }
      ~Bracket() { p.end_collective(std::uncaught_exceptions() > unwinding); }
    } bracket(*ch.protocol);
    body(ch, stream, seq);
  } catch (const c10::Error&) {
    // Argument errors are raised before anything is issued; anything later is fatal.
    throw;
  } catch (const std::exception& e) {
    // Counters have advanced and lanes may be half issued: the group cannot go on.
    broken_ = e.what();
    C10_THROW_ERROR(DistBackendError, broken_);
  }

  std::unique_ptr<DeviceCompletion> done = on_device->finish(keep, outputs, blocking, ends_with_op);
  return c10::make_intrusive<OdcWork>(getRank(), type, std::move(outputs), std::move(keep),
                                      ch.transport, std::move(done));
}

c10::intrusive_ptr<c10d::Work> OdcBackend::run(Kind kind, std::vector<at::Tensor>& outputs,
                                               std::vector<at::Tensor>& inputs, bool async_op,
                                               const c10d::ReduceOp* op, const char* api) {
  const bool ag = kind == Kind::AllGather;
  const int world = getSize();
  // ---- Validate everything before anything is enqueued.
  ODC_CHECK(!inputs.empty() && inputs.size() == outputs.size(), ValueError, "odc: ", api,
                    " needs as many outputs as inputs (got ", outputs.size(), " and ",
                    inputs.size(), ")");
  const c10::Device device = inputs[0].device();
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& in = inputs[i];
    const at::Tensor& out = outputs[i];
    check_tensor(in, device, api, "input");
    check_tensor(out, device, api, "output");
    ODC_CHECK(in.scalar_type() == out.scalar_type(), TypeError, "odc: ", api,
                     ": input and output dtype differ (", c10::toString(in.scalar_type()),
                     " vs ", c10::toString(out.scalar_type()), ")");
    const int64_t big = ag ? out.numel() : in.numel();
    const int64_t small = ag ? in.numel() : out.numel();
    ODC_CHECK(big == small * world, ValueError, "odc: ", api, ": size mismatch: ",
                      ag ? "output" : "input", " has ", big, " elements but must have ",
                      ag ? "input" : "output", " size x world size = ", small, " x ", world);
  }
  // One reduction spec per tensor (a coalesced call may mix dtypes); also checks the dtype.
  std::vector<ReduceSpec> specs(inputs.size());
  RedOp red_op = RedOp::Sum;
  std::vector<at::Tensor> keep(inputs.begin(), inputs.end());  // tensor PREMUL factors too
  if (!ag) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      specs[i] = reduce_spec(inputs[i], *op, api, keep, &red_op);
    }
  }
  const auto type = inputs.size() > 1 ? c10d::OpType::COALESCED
                    : ag              ? c10d::OpType::_ALLGATHER_BASE
                                      : c10d::OpType::_REDUCE_SCATTER_BASE;
  return launch(device, async_op, type, outputs, std::move(keep),
                [&](Channel& ch, void* stream, uint64_t seq) {
    uint64_t bytes = 0;
    ch.transport->begin_op(stream, ag ? Transport::kAgRing : Transport::kRsRing);
    for (size_t i = 0; i < inputs.size(); ++i) {
      const size_t elem = inputs[i].element_size();
      const size_t per_rank = (ag ? inputs[i] : outputs[i]).numel() * elem;
      // What this rank calls, for the peers to check against theirs (ODC_MATCH_CHECK).
      const uint64_t d = desc(ag ? OpKind::AllGather : OpKind::ReduceScatter, inputs[i], per_rank,
                              red_op, !ag);
      std::vector<const char*> in_at;
      RegisteredId id;
      if (registered_inputs(ch, ag, inputs[i], outputs[i], per_rank, &in_at, &id)) {
        const bool push = ag && ch.push_all_gather;
        const OpKind kind = !ag  ? OpKind::ReduceScatterRegistered
                            : push ? OpKind::AllGatherRegisteredPush
                                   : OpKind::AllGatherRegistered;
        // A push writes into the peers' memory: its descriptor (with the buffer's place) is
        // always checked, also with ODC_MATCH_CHECK=0.
        const uint64_t rd = push ? op_desc(kind, static_cast<int>(inputs[i].scalar_type()), per_rank, 0)
                                 : desc(kind, inputs[i], per_rank, red_op, !ag);
        if (ag) {
          ch.protocol->all_gather_registered(outputs[i].data_ptr(), in_at, per_rank, id, seq, rd,
                                             push);
          if (push) count(Stat::AllGatherPushOps, 1);
        } else {
          ch.protocol->reduce_scatter_registered(outputs[i].data_ptr(), in_at, outputs[i].numel(),
                                                 elem, specs[i], id, seq, rd);
        }
        bytes += per_rank * world;
        count(Stat::RegisteredOps, 1);
      } else if (ag) {
        ch.protocol->all_gather(outputs[i].data_ptr(), inputs[i].data_ptr(), per_rank, seq, d);
        bytes += per_rank * world;
      } else {
        ch.protocol->reduce_scatter(outputs[i].data_ptr(), inputs[i].data_ptr(),
                                    outputs[i].numel(), elem, specs[i], seq, d);
        bytes += inputs[i].numel() * elem;
      }
    }
    ch.transport->end_op();
    count(ag ? Stat::AllGatherOps : Stat::ReduceScatterOps, 1);
    count(ag ? Stat::AllGatherBytes : Stat::ReduceScatterBytes, bytes);
    // Which engine ran it and the blocks it held: fused_ops / fused_blocks, copy_engine_...
    const Transport::EngineUse use = ch.transport->last_engine();
    if (use.engine != Transport::EngineUse::kNone) {
      const bool fused = use.engine == Transport::EngineUse::kFused;
      count(fused ? Stat::FusedOps : Stat::CopyEngineOps, 1);
      count(fused ? Stat::FusedBlocks : Stat::CopyEngineBlocks, static_cast<uint64_t>(use.blocks));
    }
  }, /*blocking=*/false, /*ends_with_op=*/true);
}

c10::intrusive_ptr<c10d::Backend> OdcBackend::across_hosts(const c10::Device& device) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    check_usable();
    const Channel& ch = channel(device);
    if (ch.hosts.empty()) return {};
    if (getRank() == 0 && !across_hosts_noted_.exchange(true)) {
      std::fprintf(stderr, "%s\n", cat("odc: group '", options_->group_name, "' has ranks on several hosts (",
                                       ch.hosts, ") and ", ch.hosts_why, ": its all-gathers and "
                                       "reduce-scatters on ", device.type() == c10::kCUDA ? "CUDA" : "CPU",
                                       " tensors go to its inner ", device.is_cuda() ? "NCCL" : "gloo",
                                       " group (docs/multi_host.md)").c_str());
    }
  }
  count(Stat::CrossHostOps, 1);
  return inner(device.type());
}

std::string OdcBackend::hosts(const c10::Device& device) {
  // "cuda" names the current GPU, as for tensors made there
  const c10::Device on = device.has_index() || device.is_cpu()
                             ? device
                             : c10::impl::getDeviceGuardImpl(device.type())->getDevice();
  std::lock_guard<std::mutex> lock(mu_);
  check_usable();
  return channel(on).hosts;
}

namespace {
c10::Device device_of(const std::vector<at::Tensor>& ts) {
  ODC_CHECK(!ts.empty() && ts[0].defined(), ValueError, "odc: collective called with no tensors");
  return ts[0].device();
}
}  // namespace

c10::intrusive_ptr<c10d::Work> OdcBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                           const c10d::AllgatherOptions& opts) {
  if (auto b = across_hosts(input.device())) return b->_allgather_base(output, input, opts);
  std::vector<at::Tensor> outs{output}, ins{input};
  return run(Kind::AllGather, outs, ins, opts.asyncOp, nullptr, "all_gather_into_tensor");
}

c10::intrusive_ptr<c10d::Work> OdcBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (auto b = across_hosts(device_of(inputs))) {
    return b->allgather_into_tensor_coalesced(outputs, inputs, opts);
  }
  return run(Kind::AllGather, outputs, inputs, opts.asyncOp, nullptr,
             "allgather_into_tensor_coalesced");
}

c10::intrusive_ptr<c10d::Work> OdcBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  if (is_bitwise(opts.reduceOp)) {  // odc reduces arithmetically: the inner backend serves these
    count(Stat::DelegatedOps, 1);
    return inner(input.device().type())->_reduce_scatter_base(output, input, opts);
  }
  if (auto b = across_hosts(input.device())) return b->_reduce_scatter_base(output, input, opts);
  std::vector<at::Tensor> outs{output}, ins{input};
  return run(Kind::ReduceScatter, outs, ins, opts.asyncOp, &opts.reduceOp,
             "reduce_scatter_tensor");
}

c10::intrusive_ptr<c10d::Work> OdcBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  if (is_bitwise(opts.reduceOp)) {
    count(Stat::DelegatedOps, 1);
    return inner(inputs.empty() ? c10::kCPU : inputs[0].device().type())
        ->reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  }
  if (auto b = across_hosts(device_of(inputs))) {
    return b->reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  }
  return run(Kind::ReduceScatter, outputs, inputs, opts.asyncOp, &opts.reduceOp,
             "reduce_scatter_tensor_coalesced");
}

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
  auto b = inner_factory_(type == c10::kCUDA ? "cuda" : "cpu");
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
// cannot serve them (serves_itself: own_collectives.cpp).
#define ODC_SERVE_OR_DELEGATE(device, own, call) \
  do {                                           \
    const c10::Device dev_ = (device);           \
    if (serves_itself(dev_)) return own;         \
    ODC_DELEGATE(dev_.type(), call);             \
  } while (0)


c10::intrusive_ptr<c10d::Work> OdcBackend::broadcast(std::vector<at::Tensor>& t,
                                                     const c10d::BroadcastOptions& o) {
  ODC_SERVE_OR_DELEGATE(device_of(t), own_broadcast(t, o), broadcast(t, o));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::allreduce(std::vector<at::Tensor>& t,
                                                     const c10d::AllreduceOptions& o) {
  ODC_SERVE_OR_DELEGATE(device_of(t), own_allreduce(t, o.reduceOp, o.asyncOp, "all_reduce"),
                        allreduce(t, o));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::allreduce_coalesced(
    std::vector<at::Tensor>& t, const c10d::AllreduceCoalescedOptions& o) {
  ODC_SERVE_OR_DELEGATE(device_of(t),
                        own_allreduce(t, o.reduceOp, o.asyncOp, "all_reduce_coalesced"),
                        allreduce_coalesced(t, o));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::reduce(std::vector<at::Tensor>& t,
                                                  const c10d::ReduceOptions& o) {
  ODC_SERVE_OR_DELEGATE(device_of(t), own_reduce(t, o), reduce(t, o));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::allgather(std::vector<std::vector<at::Tensor>>& out,
                                                     std::vector<at::Tensor>& in,
                                                     const c10d::AllgatherOptions& o) {
  ODC_SERVE_OR_DELEGATE(device_of(in), own_allgather(out, in, o), allgather(out, in, o));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
    const c10d::AllgatherOptions& o) {
  ODC_DELEGATE(device_of(in).type(), allgather_coalesced(out, in, o));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::gather(std::vector<std::vector<at::Tensor>>& out,
                                                  std::vector<at::Tensor>& in,
                                                  const c10d::GatherOptions& o) {
  ODC_SERVE_OR_DELEGATE(device_of(in), own_gather(out, in, o), gather(out, in, o));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::scatter(std::vector<at::Tensor>& out,
                                                   std::vector<std::vector<at::Tensor>>& in,
                                                   const c10d::ScatterOptions& o) {
  ODC_SERVE_OR_DELEGATE(device_of(out), own_scatter(out, in, o), scatter(out, in, o));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::reduce_scatter(
    std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
    const c10d::ReduceScatterOptions& o) {
  ODC_SERVE_OR_DELEGATE(device_of(out), own_reduce_scatter(out, in, o), reduce_scatter(out, in, o));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::alltoall_base(at::Tensor& out, at::Tensor& in,
                                                         std::vector<int64_t>& os,
                                                         std::vector<int64_t>& is,
                                                         const c10d::AllToAllOptions& o) {
  ODC_SERVE_OR_DELEGATE(in.device(), own_alltoall_base(out, in, os, is, o),
                        alltoall_base(out, in, os, is, o));
}
c10::intrusive_ptr<c10d::Work> OdcBackend::alltoall(std::vector<at::Tensor>& out,
                                                    std::vector<at::Tensor>& in,
                                                    const c10d::AllToAllOptions& o) {
  ODC_SERVE_OR_DELEGATE(device_of(in), own_alltoall(out, in, o), alltoall(out, in, o));
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
    if (serves_itself(device)) return own_barrier(device);
    ODC_DELEGATE(c10::kCUDA, barrier(o));
  }
  if (serves_itself(c10::Device(c10::kCPU))) return own_barrier(c10::Device(c10::kCPU));
  ODC_DELEGATE(c10::kCPU, barrier(o));
}

#undef ODC_SERVE_OR_DELEGATE
#undef ODC_DELEGATE

const char* stat_name(Stat s) {
  static const char* const names[] = {
      "all_gather_ops",
      "all_gather_bytes",
      "reduce_scatter_ops",
      "reduce_scatter_bytes",
      "registered_ops",
      "registered_allocations",
      "registered_fallbacks",
      "all_gather_push_ops",
      "fused_ops",
      "fused_blocks",
      "copy_engine_ops",
      "copy_engine_blocks",
      "delegated_ops",
      "cross_host_ops",
      "own_all_reduce_ops",
      "own_reduce_ops",
      "own_broadcast_ops",
      "own_all_gather_ops",
      "own_reduce_scatter_ops",
      "own_exchange_ops",
      "own_barrier_ops",
      "decoupled_gets",
      "decoupled_accumulates",
      "decoupled_syncs",
  };
  static_assert(sizeof(names) / sizeof(names[0]) == static_cast<size_t>(Stat::kCount));
  return names[static_cast<int>(s)];
}

std::map<std::string, uint64_t> OdcBackend::stats() const {
  std::map<std::string, uint64_t> out;  // the counters that moved
  for (size_t i = 0; i < stats_.size(); ++i) {
    const uint64_t v = stats_[i].load(std::memory_order_relaxed);
    if (v) out[stat_name(static_cast<Stat>(i))] = v;
  }
  return out;
}

// ---- The group-wide values odc.balance shares through the group's store: atomic counters
// for dynamic work sharing and small published values (the ranks' measured speeds).
int64_t OdcBackend::claim(const std::string& key, int64_t amount) {
  settle_default_backend_type();
  return store_->add("odc_claim/" + key, amount) - amount;
}

void OdcBackend::forget(const std::string& key) { store_->deleteKey("odc_claim/" + key); }

void OdcBackend::publish(const std::string& key, const std::string& value) {
  store_->set("odc_claim/" + key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::string OdcBackend::lookup(const std::string& key) {
  const std::vector<uint8_t> v = store_->get("odc_claim/" + key);  // waits up to the timeout
  return std::string(v.begin(), v.end());
}

}  // namespace odc
