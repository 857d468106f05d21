// Layer 5, backend: OdcBackend (backend.hpp), the c10d face: a group's life (creation,
// split, shutdown, timeout), its channels, launching the one-sided collectives on a channel,
// the counters and the store-based claims of odc.balance. Beside it: argument checks
// (checks.cpp), registered memory (registered.cpp), delegated collectives (delegated.cpp),
// the Work (work.cpp) and the device side of a launch (device_work.hpp).
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
#include <mutex>
#include <cstdio>
#include <cstring>

#include "device_work.hpp"
#include "text.hpp"
#include "work.hpp"

namespace odc {
OdcBackend::OdcBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                       c10::intrusive_ptr<odc::Options> options, InnerFactory inner,
                       CreatedHook on_split)
    : Backend(rank, size),
      store_(std::move(store)),
      options_(options ? std::move(options) : odc::Options::create()),
      timeout_ms_(std::make_shared<std::atomic<int64_t>>(options_->timeout.count())),
      inner_factory_(std::move(inner)),
      on_split_(std::move(on_split)) {
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
  const std::vector<int> parent = global_ranks();
  std::vector<int> global;
  for (int r : ranks) global.push_back(parent[r]);
  // The new group's options: odc options handed back (c10d's copy of getBackendOptions, or
  // the caller's), else this group's; then the new group's name, ranks and timeout.
  const auto* given = dynamic_cast<const odc::Options*>(opts.get());
  c10::intrusive_ptr<odc::Options> o = given ? given->copy() : options_->copy();
  o->group_name = opts && !opts->group_name.empty() ? opts->group_name
                                                     : options_->group_name + ":split";
  o->global_ranks_in_group.assign(global.begin(), global.end());
  o->timeout = opts ? opts->timeout : options_->timeout;
  // The new group's keys live apart from those of other backends split with it (gloo).
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("odc/", store);
  auto made = c10::make_intrusive<OdcBackend>(prefixed, static_cast<int>(me - ranks.begin()),
                                             static_cast<int>(ranks.size()), o, inner_factory_,
                                             on_split_);
  if (on_split_) on_split_(made);
  return made;
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
  // The set-up allocates and opens IPC memory and synchronizes: never inside a CUDA graph's
  // capture (the first call that reaches it may be any of the group's, e.g. across_hosts).
  (void)current_stream(device, "a group's first operation");
  Channel ch = make_channel(device, *options_, timeout_ms_, store_, getRank(), getSize());
  return channels_.emplace(device.type(), std::move(ch)).first->second;
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
  (void)current_stream(device, "a collective");  // refuses graph capture before anything is issued
  Channel& ch = channel(device);
  ODC_CHECK(ch.transport, ValueError, cross_host_refusal(ch, *options_, c10d::opTypeToString(type)));
  {
    const std::string err = ch.transport->async_error();
    if (!err.empty()) {
      broken_ = err;
      C10_THROW_ERROR(DistBackendError, err);
    }
  }
  // (before the collective's number: a launch refused here issues nothing)
  const std::unique_ptr<DeviceLaunch> on_device = begin_launch(ch, async_op);
  const uint64_t seq = ++seq_;
  void* stream = on_device->stream();
  try {
    const Protocol::Collective collective(*ch.protocol);  // numbered and announced to the peers
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
  // Validate everything before anything is enqueued.
  const c10::Device device = check_collective(outputs, inputs, ag, world, api);
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
    issue_collective(ch, stream, seq, ag, inputs, outputs, specs, red_op);
  }, /*blocking=*/false, /*ends_with_op=*/true);
}

void OdcBackend::count_engine(Channel& ch) {
  const Transport::EngineUse use = ch.protocol->last_engine();
  if (use.engine == Transport::EngineUse::kNone) return;
  const bool fused = use.engine == Transport::EngineUse::kFused;
  count(fused ? Stat::FusedOps : Stat::CopyEngineOps, 1);
  count(fused ? Stat::FusedBlocks : Stat::CopyEngineBlocks, static_cast<uint64_t>(use.blocks));
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

const char* stat_name(Stat s) {
  static const char* const names[] = {
      "all_gather_ops",
      "all_gather_bytes",
      "reduce_scatter_ops",
      "reduce_scatter_bytes",
      "registered_ops",
      "registered_allocations",
      "registered_fallbacks",
      "registered_pool_bytes",
      "all_gather_push_ops",
      "direct_ops",
      "direct_in_place_ops",
      "direct_pushed_ops",
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
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [type, ch] : channels_) {  // counted on the device (pushed all-gathers)
    if (!ch.zero_copy) continue;
    const auto [pushes, confirmed] = ch.zero_copy->guessed_pushes();
    if (pushes) out["guessed_pushes"] += pushes;
    if (confirmed) out["guessed_push_hits"] += confirmed;
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
