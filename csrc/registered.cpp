// Layer 5, backend: registered memory on the c10d face (backend.hpp): allocate_tensor hands
// out memory of the group's pool (pool.hpp), and a collective whose buffers lie in it runs
// zero-copy.
#include "backend.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/exception.h>

#include "device_work.hpp"
#include "text.hpp"

namespace odc {

// Before the pool's n-th arena: every rank must grow it by the same size, under the same
// limit, else one offset would name different places on different ranks. Each tells the
// others through the group's store and waits for theirs up to the group's timeout.
void OdcBackend::agree_on_growth(const c10::Device& device, size_t n, size_t bytes, size_t cap) {
  const std::string key = cat("odc_pool_growth/", device.type() == c10::DeviceType::CUDA ? "cuda" : "cpu",
                              "/", n, "/");
  const std::string mine = cat(bytes, " ", cap);
  store_->set(key + std::to_string(getRank()), std::vector<uint8_t>(mine.begin(), mine.end()));
  const std::chrono::milliseconds timeout(timeout_ms_->load(std::memory_order_relaxed));
  for (int r = 0; r < getSize(); ++r) {
    try {
      store_->wait({key + std::to_string(r)}, timeout);
    } catch (const std::exception&) {
      C10_THROW_ERROR(DistBackendError,
                      cat("odc: allocate_tensor: rank ", getRank(), " grows its registered memory "
                          "and rank ", r, " did not take that step within ", timeout.count(),
                          " ms: the ranks must allocate and free the same sizes in the same order "
                          "(or rank ", r, " is dead or stuck)"));
    }
    const std::vector<uint8_t> v = store_->get(key + std::to_string(r));
    const std::string theirs(v.begin(), v.end());
    const size_t space = theirs.find(' ');
    ODC_CHECK(theirs.substr(space + 1) == std::to_string(cap), DistBackendError,
              "odc: allocate_tensor: rank ", getRank(), " has ODC_POOL_BYTES ", cap, " and rank ",
              r, " has ", theirs.substr(space + 1), ": every rank of a group needs the same");
    ODC_CHECK(theirs == mine, DistBackendError,
              "odc: allocate_tensor: rank ", getRank(), " grows its registered memory by ", bytes,
              " bytes and rank ", r, " by ", theirs.substr(0, space), " at the same step: the ranks "
              "must allocate and free the same sizes in the same order");
  }
}

// No room for `need` bytes: grow the pool by an arena (collective), unless that would pass
// ODC_POOL_BYTES. The ranks' pools evolve alike (the same sizes allocated and freed in the
// same order), so every rank grows at this same allocation. Under mu_.
bool OdcBackend::grow_pool(Channel& ch, const c10::Device& device, size_t need) {
  RegisteredPool& pool = *ch.pool;
  const bool cuda = device.is_cuda();
  const size_t cap = options_->pool_bytes_for(cuda);
  const size_t held = pool.bytes();
  if (held + need > cap) return false;
  const size_t grow = std::min(cap - held,  // >= need, a multiple of kAlign
                               std::max(need, cuda ? kPoolStepCuda : kPoolStepCpu)) /
                      RegisteredPool::kAlign * RegisteredPool::kAlign;
  int arena = 0;
  // A growth that fails leaves the ranks' pools (and arenas) apart: the group is unusable.
  try {
    agree_on_growth(device, pool.arenas(), grow, cap);
    try {
      arena = ch.arenas->create_arena(grow);  // collective
    } catch (const std::exception& e) {
      C10_THROW_ERROR(DistBackendError,
                      cat("odc: allocate_tensor: growing registered memory by ", grow,
                          " bytes failed (a lower ODC_POOL_BYTES keeps the rest on the staged "
                          "path): ", e.what()));
    }
  } catch (const c10::DistBackendError& e) {
    broken_ = e.what_without_backtrace();
    throw;
  }
  std::vector<char*> bases;
  for (int r = 0; r < getSize(); ++r) bases.push_back(ch.arenas->arena(arena, r));
  pool.add_arena(std::move(bases), grow);
  count(Stat::RegisteredPoolBytes, grow);
  return true;
}

at::Tensor OdcBackend::allocateTensor(long size, at::TensorOptions options) {
  const c10::Device device = options.device();
  ODC_CHECK(size >= 0, ValueError, "odc: allocate_tensor: negative size ", size);
  ODC_CHECK(device.is_cpu() || device.is_cuda(), ValueError,
            "odc: allocate_tensor: unsupported device ", device);
  settle_default_backend_type();
  const size_t bytes = static_cast<size_t>(size) * options.dtype().itemsize();
  std::shared_ptr<RegisteredPool> pool;
  size_t off = SIZE_MAX;
  {
    std::lock_guard<std::mutex> lock(mu_);
    check_usable();
    Channel& ch = channel(device);
    if (!ch.pool && ch.arenas && ch.arenas->maps_every_peer()) {
      ch.pool = std::make_shared<RegisteredPool>(getRank(), stream_order(device));
    }
    pool = ch.pool;
    if (pool) off = pool->allocate(bytes);
    if (off == SIZE_MAX && pool && grow_pool(ch, device, RegisteredPool::footprint(bytes))) {
      off = pool->allocate(bytes);
    }
  }
  if (off == SIZE_MAX) {  // full (or no pool): ordinary memory, the staged path
    count(Stat::RegisteredFallbacks, 1);
    return at::empty({size}, options);
  }
  count(Stat::RegisteredAllocations, 1);
  return at::from_blob(pool->address(getRank(), off), {size},
                       [pool, off](void*) { pool->free(off); }, options);
}

}  // namespace odc
