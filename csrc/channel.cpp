// Layer 4, channel: the transport factory (channel.hpp). Picks and sets up a device's
// transport from the options: host shared memory for CPU tensors; for CUDA tensors the CUDA
// transport over CUDA IPC memory, or over NVSHMEM's heap where options route some peer; none
// where the group's ranks are on several hosts that these do not connect.
#include "channel.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <vector>

#include "text.hpp"
#include "transport_shm.hpp"
#ifdef ODC_WITH_NVSHMEM
#include "cuda/nvshmem_runtime.hpp"
#endif

#ifdef ODC_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/cuda_transport.hpp"
#endif

namespace odc {

namespace {
std::vector<uint8_t> this_host() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return std::vector<uint8_t>(host, host + std::strlen(host));
}

// Every rank's host, as each rank labels its own: its host name, and with ODC_HOST_SIZE its
// block of global ranks too (emulated hosts on one machine share a name). Ranks with
// different labels are on different hosts; every rank sees the same labels (collective).
std::vector<std::string> host_labels(const TransportArgs& a, const Options& o) {
  const std::vector<uint8_t> name = this_host();
  std::string mine(name.begin(), name.end());
  const int64_t g = o.global_ranks_in_group.empty() ? a.rank : o.global_ranks_in_group[a.rank];
  if (o.host_size > 0) mine += cat(" #", g / o.host_size);
  std::vector<std::string> labels;
  for (const auto& l : exchange_blobs(a, "host", std::vector<uint8_t>(mine.begin(), mine.end()))) {
    labels.emplace_back(l.begin(), l.end());
  }
  return labels;
}

// "'a' (ranks 0, 1), 'b' (ranks 2, 3)": the group's ranks by host, hosts in order of their
// first rank.
std::string describe_hosts(const std::vector<std::string>& labels) {
  std::vector<std::string> hosts;
  std::vector<std::string> ranks;
  for (size_t r = 0; r < labels.size(); ++r) {
    const size_t h = std::find(hosts.begin(), hosts.end(), labels[r]) - hosts.begin();
    if (h == hosts.size()) {
      hosts.push_back(labels[r]);
      ranks.emplace_back();
    }
    ranks[h] += cat(ranks[h].empty() ? "" : ", ", r);
  }
  std::string out;
  for (size_t h = 0; h < hosts.size(); ++h) {
    out += cat(h ? ", '" : "'", hosts[h], "' (rank", ranks[h].find(',') == std::string::npos ? " " : "s ",
               ranks[h], ")");
  }
  return out;
}

// Marks the channel as spanning hosts odc does not connect when some two ranks that `routed`
// does not connect otherwise are on different hosts: its collectives then go to the inner
// backend. Decided over every pair, so that every rank decides alike.
bool spans_hosts(Channel& ch, const std::vector<std::string>& labels,
                 const std::function<bool(int, int)>& routed, std::string why) {
  const int n = static_cast<int>(labels.size());
  for (int r = 0; r < n; ++r) {
    for (int q = 0; q < r; ++q) {
      if (labels[q] != labels[r] && !routed(q, r)) {
        ch.hosts = describe_hosts(labels);
        ch.hosts_why = std::move(why);
        return true;
      }
    }
  }
  return false;
}
}  // namespace

std::string cross_host_refusal(const Channel& ch, const Options& options, const std::string& what) {
  return cat("odc: group '", options.group_name, "' cannot run ", what,
             " one-sidedly: its ranks are on several hosts (", ch.hosts, ") and ", ch.hosts_why,
             ". Keep one-sided work inside a host: HSDP with the shard dimension inside a host "
             "(init_device_mesh(device, (hosts, ranks_per_host), mesh_dim_names=('replicate', "
             "'shard'))) runs odc within each host and NCCL (gloo for CPU tensors) across; or build with "
             "ODC_WITH_NVSHMEM=1 on hosts with RDMA NICs and set ODC_HOST_SIZE. See "
             "docs/multi_host.md");
}

#ifdef ODC_WITH_CUDA
namespace {
// Every rank's place: its host name, then '/' and its GPU's UUID.
std::vector<std::vector<uint8_t>> gpu_places(const TransportArgs& a, int device) {
  cudaDeviceProp prop;
  C10_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::vector<uint8_t> mine = this_host();
  mine.push_back('/');
  mine.insert(mine.end(), prop.uuid.bytes, prop.uuid.bytes + sizeof(prop.uuid.bytes));
  return exchange_blobs(a, "device", mine);
}

// Whether another rank of the group uses this GPU (host name and device UUID compared):
// NCCL refuses such groups, so odc then serves the inner backend's collectives itself.
bool shared_by_ranks(const TransportArgs& a, const std::vector<std::vector<uint8_t>>& places) {
  for (int r = 0; r < a.world; ++r) {
    if (r != a.rank && places[r] == places[a.rank]) return true;
  }
  return false;
}
}  // namespace
#endif

namespace {
// The CUDA transport of `ch` (none where the group spans hosts no odc transport connects).
void set_cuda_transport(Channel& ch, const TransportArgs& a, const Options& options) {
#ifdef ODC_WITH_CUDA
  const odc::Options& o = options;
  const c10::Device device = ch.device;
  const int rank = a.rank, size = a.world;
  // Per peer: CUDA IPC on this host; NVSHMEM for peers on other hosts (ODC_HOST_SIZE),
  // or for every peer with ODC_TRANSPORT=nvshmem.
  std::vector<int> pes(options.global_ranks_in_group.begin(), options.global_ranks_in_group.end());
  std::vector<bool> routed(size, false);
  for (int r = 0; r < size; ++r) routed[r] = o.routes_peer(pes[rank], pes[r]);
  // CUDA IPC reaches only this host's GPUs: a peer on another host (by name, or by
  // ODC_HOST_SIZE) that NVSHMEM does not route leaves the group to the inner NCCL group.
  const auto places = gpu_places(a, device.index());
  if (spans_hosts(ch, host_labels(a, o),
                  [&](int q, int r) { return o.routes_peer(pes[q], pes[r]); },
                  o.transport == TransportKind::CudaIpc
                      ? "ODC_TRANSPORT=ipc keeps odc's CUDA transport inside a host"
                      : (kBuiltWithNvshmem ? "ODC_HOST_SIZE does not split the hosts where their names do"
                                           : "this build has no NVSHMEM, odc's only transport between GPUs of different hosts"))) {
    return;
  }
  std::unique_ptr<DeviceMemory> memory;  // nullptr: CUDA IPC
  const std::vector<int64_t> group(pes.begin(), pes.end());
  if (o.uses_nvshmem(group)) {
#ifdef ODC_WITH_NVSHMEM
    memory = nvshmem::make_memory(std::move(pes), std::move(routed), device.index(),
                                  options.nvshmem_stage_always);
#else
    ODC_CHECK(false, ValueError, "odc: ",
              o.transport == TransportKind::Nvshmem ? "ODC_TRANSPORT=nvshmem" : "a group with peers on other hosts",
              " needs a build with NVSHMEM (ODC_WITH_NVSHMEM=1 python setup.py build_ext)");
#endif
  }
  bool other_gpus = false;  // some peer on another GPU of this host (CUDA IPC over NVLink)
  int on_gpu = 0;           // ranks of the group on this GPU (their kernels share its SMs)
  for (int r = 0; r < size; ++r) {
    other_gpus = other_gpus || (!routed[r] && places[r] != places[rank]);
    on_gpu += !routed[r] && places[r] == places[rank];
  }
  ch.transport = std::make_unique<CudaIpcTransport>(a, device.index(), o.reduce_blocks,
                                                    o.accumulate_blocks, o.small_op_bytes,
                                                    o.fused_blocks, on_gpu,
                                                    o.stream_memops, other_gpus, std::move(memory));
  ch.async_stream = take_async_stream(device.index());
  ch.shares_device = shared_by_ranks(a, places);
  // Pushes need every peer's memory mapped (no routed peer).
  bool own_gpus = true;
  for (int r = 0; r < size; ++r) {
    own_gpus = own_gpus && !routed[r];
    for (int q = 0; q < r; ++q) own_gpus = own_gpus && places[q] != places[r];
  }
  ch.push_all_gather = o.pushes_all_gathers(size, own_gpus);
#else
  ODC_CHECK(false, Error, "odc: this build of torch_odc_backend has no CUDA support (it was "
                     "built against a CPU-only torch); rebuild it where torch has CUDA");
#endif
}

// The shared-memory transport of `ch` (none where the group spans hosts).
void set_host_transport(Channel& ch, const TransportArgs& a, const Options& options) {
  ODC_CHECK(ch.device.is_cpu(), ValueError, "odc: unsupported device ", ch.device,
                    " (odc moves CPU and CUDA tensors)");
  // Shared memory reaches only this host's processes: a group with ranks on several
  // hosts (by name, or by ODC_HOST_SIZE) leaves its CPU tensors to the inner gloo group.
  if (spans_hosts(ch, host_labels(a, options), [](int, int) { return false; },
                  "odc moves CPU tensors through one host's shared memory only")) {
    return;
  }
  ch.transport = std::make_unique<ShmTransport>(a);
  ch.push_all_gather = options.ag_push == 1;
}
}  // namespace

Channel make_channel(const c10::Device& device, const Options& options,
                     std::shared_ptr<const std::atomic<int64_t>> timeout_ms,
                     const c10::intrusive_ptr<c10d::Store>& store, int rank, int size) {
  Channel ch;
  ch.device = device;
  const bool cuda = device.is_cuda();
  TransportArgs a;
  a.store = store;
  a.rank = rank;
  a.world = size;
  a.timeout_ms = std::move(timeout_ms);
  a.key_prefix = cuda ? "odc_cuda/" : "odc_shm/";
  const size_t chunk = options.chunk_bytes_for(cuda);
  const int slots = options.ring_slots;
  try {
    a.layout = WindowLayout(size, chunk, slots);
    if (cuda) {
      set_cuda_transport(ch, a, options);
    } else {
      set_host_transport(ch, a, options);
    }
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    ODC_CHECK(false, Error, "odc: could not set up the ",
              (cuda ? "CUDA" : "shared-memory"),
                " transport of group '", options.group_name, "' (", a.layout.total >> 20,
                " MiB window): ", e.what());
  }
  if (!ch.transport) return ch;  // ranks on several hosts: the inner backend serves the group
  ch.protocol = std::make_unique<Protocol>(rank, size, a.layout, ch.transport.get());
  return ch;
}

#ifdef ODC_WITH_CUDA
namespace {
std::mutex g_async_mu;
std::map<int, std::vector<void*>>& free_async_streams() {
  static auto* free = new std::map<int, std::vector<void*>>();  // never destroyed, as its streams
  return *free;
}
}  // namespace

void* take_async_stream(int device) {
  {
    std::lock_guard<std::mutex> lock(g_async_mu);
    auto& free = free_async_streams()[device];
    if (!free.empty()) {
      void* s = free.back();
      free.pop_back();
      return s;
    }
  }
  c10::cuda::CUDAGuard g(static_cast<c10::DeviceIndex>(device));
  cudaStream_t s;
  int lo = 0, hi = 0;
  C10_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  C10_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, hi));
  return s;
}

void give_async_stream(int device, void* stream) {
  std::lock_guard<std::mutex> lock(g_async_mu);
  free_async_streams()[device].push_back(stream);
}
#endif

}  // namespace odc
