// Layer 4, channel: the choice of a device's transport (channel.hpp). Where the ranks are
// (placement.hpp) and the options pick it: host shared memory for CPU tensors; for CUDA
// tensors the CUDA transport (cuda_setup.hpp) over CUDA IPC memory, or over NVSHMEM's heap
// where options route some peer; none where the group's ranks are on several hosts that
// these do not connect.
#include "channel.hpp"

#include <string>
#include <vector>

#include "agreement.hpp"
#include "cuda_setup.hpp"
#include "placement.hpp"
#include "text.hpp"
#include "transport_shm.hpp"

namespace odc {

namespace {
// Marks the channel as spanning hosts odc does not connect (the placement says which): its
// collectives then go to the inner backend.
bool spans_hosts(Channel& ch, const Placement& p, std::string why) {
  if (p.unconnected_hosts.empty()) return false;
  ch.hosts = p.unconnected_hosts;
  ch.hosts_why = std::move(why);
  return true;
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

PlacementChoices placement_choices(const Placement& p, const Options& o) {
  PlacementChoices c;
  c.shares_device = p.some_ranks_share_a_gpu();
  c.own_gpus = p.own_gpus();
  c.push_all_gather = o.pushes_all_gathers(static_cast<int>(p.gpus.size()), p.own_gpus());  // pushes map every peer
  return c;
}

namespace {
// The CUDA transport of `ch` (none where the group spans hosts no odc transport connects).
void set_cuda_transport(Channel& ch, const TransportArgs& a, const Options& o) {
  ODC_CHECK(kBuiltWithCuda, Error, "odc: this build of torch_odc_backend has no CUDA support (it "
            "was built against a CPU-only torch); rebuild it where torch has CUDA");
  const int device = ch.device.index();
  // Per peer: CUDA IPC on this host; NVSHMEM for peers on other hosts (ODC_HOST_SIZE),
  // or for every peer with ODC_TRANSPORT=nvshmem. A peer on another host that NVSHMEM does
  // not route leaves the group to the inner NCCL group.
  const Placement p = place_gpu_ranks(a, o, gpu_uuid(device));
  if (spans_hosts(ch, p, o.transport == TransportKind::CudaIpc
                             ? "ODC_TRANSPORT=ipc keeps odc's CUDA transport inside a host"
                         : kBuiltWithNvshmem
                             ? "ODC_HOST_SIZE does not split the hosts where their names do"
                             : "this build has no NVSHMEM, odc's only transport between GPUs of "
                               "different hosts")) {
    return;
  }
  CudaTransportOptions t;
  t.device = device;
  t.reduce_blocks = o.reduce_blocks;
  t.accumulate_blocks = o.accumulate_blocks;
  t.small_op_bytes = o.small_op_bytes;
  t.fused_blocks = o.fused_blocks;
  t.stream_memops = o.stream_memops;
  t.ranks_on_gpu = p.ranks_on_gpu();
  t.peers_on_other_gpus = p.peers_on_other_gpus();
  t.pes.assign(o.global_ranks_in_group.begin(), o.global_ranks_in_group.end());
  t.nvshmem = o.uses_nvshmem(std::vector<int64_t>(t.pes.begin(), t.pes.end()));
  ODC_CHECK(!t.nvshmem || kBuiltWithNvshmem, ValueError, "odc: ",
            o.transport == TransportKind::Nvshmem ? "ODC_TRANSPORT=nvshmem" : "a group with peers on other hosts",
            " needs a build with NVSHMEM (ODC_WITH_NVSHMEM=1 python setup.py build_ext)");
  t.nvshmem_stage_always = o.nvshmem_stage_always;
  t.routed = p.routed;
  t.zero_copy = o.zero_copy && !t.nvshmem;  // every peer over CUDA IPC
  ch.transport = make_cuda_transport(a, t);
  ch.async_stream = take_async_stream(device);
  const PlacementChoices c = placement_choices(p, o);
  ch.shares_device = c.shares_device;
  ch.own_gpus = c.own_gpus;
  ch.push_all_gather = c.push_all_gather;
}

// The shared-memory transport of `ch` (none where the group spans hosts).
void set_host_transport(Channel& ch, const TransportArgs& a, const Options& options) {
  ODC_CHECK(ch.device.is_cpu(), ValueError, "odc: unsupported device ", ch.device,
                    " (odc moves CPU and CUDA tensors)");
  // Shared memory reaches only this host's processes: a group with ranks on several
  // hosts (by name, or by ODC_HOST_SIZE) leaves its CPU tensors to the inner gloo group.
  if (spans_hosts(ch, place_host_ranks(a, options),
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
    check_settings_agree(a, options.group_name, shared_settings(options, cuda));
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
  ch.zero_copy = ch.transport->zero_copy_reads();
  ch.arenas = ch.transport->arenas();
  ch.protocol = std::make_unique<Protocol>(rank, size, a.layout, ch.transport.get(), ch.zero_copy);
  return ch;
}

}  // namespace odc
