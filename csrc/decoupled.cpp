// Layer 5, backend: decoupled mode's bound arena (decoupled.hpp).
#include "decoupled.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/exception.h>

#include "device_work.hpp"
#include "text.hpp"

namespace odc {

namespace {
void check_arena_tensor(const at::Tensor& t, const c10::Device& device, size_t bytes,
                        const char* what) {
  ODC_CHECK(t.defined() && t.is_contiguous(), ValueError, "odc: decoupled ", what,
            ": the tensor must be defined and contiguous");
  ODC_CHECK(t.device() == device, ValueError, "odc: decoupled ", what, ": tensor on ",
            t.device(), " but the arena is on ", device);
  ODC_CHECK(t.numel() * t.element_size() == static_cast<int64_t>(bytes), ValueError,
            "odc: decoupled ", what, ": ", t.numel() * t.element_size(), " bytes given, ",
            bytes, " expected (the parameter group's layout changed?)");
}
}  // namespace

DecoupledArena::DecoupledArena(c10::intrusive_ptr<OdcBackend> backend, c10::Device device,
                               std::unique_ptr<Arena> arena, Transport* transport,
                               Arenas* arenas)
    : backend_(std::move(backend)),
      device_(device),
      arena_(std::move(arena)),
      transport_(transport),
      arenas_(arenas) {}

void DecoupledArena::check_group(int64_t group, const char* what) const {
  ODC_CHECK(group >= 0 && group < static_cast<int64_t>(arena_->layout().numel.size()),
            ValueError, "odc: decoupled ", what, ": unknown parameter group ", group);
}

template <typename F>
void DecoupledArena::call(F&& body) {
  OdcBackend& b = *backend_;
  b.settle_default_backend_type();
  std::lock_guard<std::mutex> lock(b.mu_);
  b.check_usable();
  ODC_CHECK(!released_, ValueError, "odc decoupled mode: this model's arena was released "
            "(odc.release); call odc.restore(model) before using it again");
  try {
    body();
  } catch (const c10::Error&) {
    throw;  // argument errors: nothing was issued
  } catch (const std::exception& e) {
    // a timeout, a dead peer or a failed launch: counters may be half advanced
    b.broken_ = e.what();
    C10_THROW_ERROR(DistBackendError, b.broken_);
  }
}

template <typename F>
void DecoupledArena::op(Ring ring, F&& fn) {
  const std::string err = transport_->async_error();
  if (!err.empty()) throw CommError(err);
  transport_->begin_op(current_stream(device_, "a decoupled get or add"), ring);
  fn();
  transport_->end_op();
}

std::shared_ptr<DecoupledArena> DecoupledArena::create(
    c10::intrusive_ptr<OdcBackend> backend, const c10::Device& device,
    const std::vector<int64_t>& shard_numel, const std::vector<int64_t>& param_elem_size,
    const std::vector<int64_t>& grad_numel) {
  OdcBackend& b = *backend;
  std::shared_ptr<DecoupledArena> made;
  b.settle_default_backend_type();
  std::lock_guard<std::mutex> lock(b.mu_);
  b.check_usable();
  try {
    ODC_CHECK(shard_numel.size() == param_elem_size.size() &&
                  shard_numel.size() == grad_numel.size(),
              ValueError, "odc: decoupled: one shard size, element size and gradient size per "
              "parameter group expected");
    for (size_t g = 0; g < shard_numel.size(); ++g) {
      ODC_CHECK(shard_numel[g] >= 0 && grad_numel[g] >= 0 && grad_numel[g] <= shard_numel[g] &&
                    (param_elem_size[g] == 2 || param_elem_size[g] == 4 ||
                     param_elem_size[g] == 8),
                ValueError, "odc: decoupled: bad sizes for parameter group ", g);
    }
    Channel& ch = b.channel(device);
    ODC_CHECK(ch.transport, ValueError, cross_host_refusal(ch, b.options(), "odc.decouple"));
    bool accumulators = false;
    for (int64_t g : grad_numel) accumulators = accumulators || g > 0;
    ODC_CHECK(ch.arenas, ValueError, "odc.decouple: this group's transport has no arenas");
    ODC_CHECK(!accumulators || ch.arenas->accumulates_everywhere(), ValueError,
              "odc: decoupled mode's put-accumulate cannot reach peers over NVSHMEM (no float "
              "atomics): use odc.decouple(model, optimizer, accumulate='local')");
    std::vector<size_t> n(shard_numel.begin(), shard_numel.end());
    std::vector<size_t> e(param_elem_size.begin(), param_elem_size.end());
    std::vector<size_t> gn(grad_numel.begin(), grad_numel.end());
    ArenaLayout layout(b.getSize(), n, e, gn);
    int tid = -1;
    try {
      tid = ch.arenas->create_arena(layout.total);
    } catch (const CommError&) {
      throw;
    } catch (const std::exception& ex) {
      C10_THROW_ERROR(Error, cat("odc: could not create the decoupled-mode arena (",
                                 layout.total >> 20, " MiB): ", ex.what()));
    }
    made.reset(new DecoupledArena(
        backend, device,
        std::make_unique<Arena>(b.getRank(), b.getSize(), std::move(layout), ch.transport.get(),
                                ch.arenas, tid),
        ch.transport.get(), ch.arenas));
  } catch (const c10::Error&) {
    throw;  // argument errors: nothing was issued
  } catch (const std::exception& e) {
    b.broken_ = e.what();
    C10_THROW_ERROR(DistBackendError, b.broken_);
  }
  return made;
}

void DecoupledArena::publish(int64_t group, const at::Tensor& shard) {
  call([&] {
    check_group(group, "publish");
    check_arena_tensor(shard, device_, arena_->layout().pub_bytes[group], "publish");
    op(Ring::kArenaSync, [&] { arena_->publish(static_cast<int>(group), shard.data_ptr()); });
  });
}

void DecoupledArena::announce(int64_t epoch) {
  call([&] {
    op(Ring::kArenaSync, [&] { arena_->announce(static_cast<uint64_t>(epoch)); });
  });
}

void DecoupledArena::get(int64_t group, const at::Tensor& out, int64_t epoch) {
  call([&] {
    check_group(group, "all_gather");
    check_arena_tensor(out, device_, arena_->layout().pub_bytes[group] * backend_->getSize(),
                       "all_gather output");
    const uint64_t seq = ++backend_->seq_;
    op(Ring::kArenaGet, [&] {
      arena_->get(static_cast<int>(group), out.data_ptr(), static_cast<uint64_t>(epoch), seq);
    });
    backend_->count(Stat::DecoupledGets, 1);
  });
}

void DecoupledArena::accumulate(int64_t group, const at::Tensor& in) {
  call([&] {
    check_group(group, "reduce_scatter");
    const DType dtype = to_dtype(in.scalar_type(), "decoupled reduce_scatter");
    check_arena_tensor(in, device_,
                       arena_->layout().grad_numel[group] * backend_->getSize() * in.element_size(),
                       "reduce_scatter input");
    op(Ring::kArenaPut,
       [&] { arena_->accumulate(static_cast<int>(group), in.data_ptr(), dtype); });
    backend_->count(Stat::DecoupledAccumulates, 1);
  });
}

void DecoupledArena::finish(int64_t epoch, bool groups_too) {
  call([&] {
    const uint64_t seq = ++backend_->seq_;
    op(Ring::kArenaSync,
       [&] { arena_->finish(static_cast<uint64_t>(epoch), seq, groups_too); });
    backend_->count(Stat::DecoupledSyncs, 1);
  });
}

void DecoupledArena::take(int64_t group, const at::Tensor& out) {
  call([&] {
    check_group(group, "sync");
    ODC_CHECK(out.scalar_type() == at::kFloat, TypeError,
              "odc: decoupled sync: accumulators are float32");
    check_arena_tensor(out, device_, arena_->layout().grad_numel[group] * sizeof(float), "sync");
    op(Ring::kArenaSync,
       [&] { arena_->take(static_cast<int>(group), out.data_ptr<float>()); });
  });
}

void DecoupledArena::group_done(int64_t group, int64_t epoch) {
  call([&] {
    check_group(group, "group_done");
    op(Ring::kArenaPut,  // the ring of its accumulates: after them
       [&] { arena_->group_done(static_cast<int>(group), static_cast<uint64_t>(epoch)); });
  });
}

void DecoupledArena::take_when_done(int64_t group, const at::Tensor& out, int64_t epoch) {
  call([&] {
    check_group(group, "take_when_done");
    ODC_CHECK(out.scalar_type() == at::kFloat, TypeError,
              "odc: decoupled sync: accumulators are float32");
    check_arena_tensor(out, device_, arena_->layout().grad_numel[group] * sizeof(float), "sync");
    const uint64_t seq = ++backend_->seq_;
    // its own ring: the caller orders it after its accumulates (the side stream waits for
    // the issuing one), and the minibatch's sync after it (through the all-reduce's Work)
    op(Ring::kArenaEarly, [&] {
      arena_->take_when_done(static_cast<int>(group), out.data_ptr<float>(),
                             static_cast<uint64_t>(epoch), seq);
    });
  });
}

int64_t DecoupledArena::side_stream() {
  call([&] {
    if (!side_stream_) side_stream_ = take_side_stream(device_);
  });
  return reinterpret_cast<int64_t>(side_stream_);
}

bool DecoupledArena::release() {
  bool freed = false;
  call([&] { freed = arenas_->release_arena(arena_->id()); });
  released_ = freed;
  return freed;
}

DecoupledArena::~DecoupledArena() {
  if (side_stream_) give_side_stream(device_, side_stream_);  // kept for later arenas
}

int64_t DecoupledArena::size() {
  int64_t bytes = 0;
  call([&] { bytes = static_cast<int64_t>(arena_->layout().total); });
  return bytes;
}

}  // namespace odc
