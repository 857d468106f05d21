// Layer 6, bindings: the Python module _C: OdcBackend (a c10d Backend), its Options, and
// build facts; the NVSHMEM runtime in NVSHMEM builds. Depends on the backend layer.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <type_traits>

#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's type casters (not torch/extension.h: the whole C++ API)

#include "backend.hpp"
#include "channel.hpp"
#include "placement.hpp"
#include "decoupled.hpp"
#ifdef ODC_WITH_NVSHMEM
#include "cuda/nvshmem_runtime.hpp"
#endif

namespace py = pybind11;

namespace {

bool python_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// Wrap a Python callable (returning R) so C++ may call it (and drop it) from any thread.
template <typename R, typename... Args>
std::function<R(Args...)> wrap_python(py::object fn) {
  if (fn.is_none()) return nullptr;
  std::shared_ptr<py::object> holder(new py::object(std::move(fn)), [](py::object* o) {
    // Taking the GIL while the interpreter finalizes ends the thread from inside this
    // destructor (std::terminate); then leaking the reference is the only safe choice.
    if (Py_IsInitialized() && !python_finalizing()) {
      py::gil_scoped_acquire gil;
      delete o;
    }
  });
  return [holder](Args... args) -> R {
    py::gil_scoped_acquire gil;
    if constexpr (std::is_void_v<R>) {
      (*holder)(args...);
    } else {
      return (*holder)(args...).template cast<R>();
    }
  };
}

using BackendClass = py::class_<odc::OdcBackend, c10d::Backend, c10::intrusive_ptr<odc::OdcBackend>>;

// The options and their enums (c10d's Options pattern), bound once; config.py fills them
// from the ODC_* environment.
void bind_options(BackendClass& backend) {
  py::enum_<odc::TransportKind>(backend, "TransportKind", "How CUDA peers are reached (ODC_TRANSPORT).")
      .value("AUTO", odc::TransportKind::Auto)
      .value("NVSHMEM", odc::TransportKind::Nvshmem)
      .value("CUDA_IPC", odc::TransportKind::CudaIpc);
  py::enum_<odc::SelfServe>(backend, "SelfServe",
                            "Who serves the collectives FSDP does not issue (ODC_SELF_SERVE).")
      .value("INNER", odc::SelfServe::Inner)
      .value("ODC", odc::SelfServe::Odc)
      .value("AUTO", odc::SelfServe::Auto);
  using O = odc::Options;
  py::class_<O, c10d::Backend::Options, c10::intrusive_ptr<O>>(
      backend, "Options", "odc's backend options (c10d's split_group copies them)")
      .def(py::init([](std::chrono::milliseconds timeout) { return O::create(timeout); }),
           py::arg("timeout") = std::chrono::milliseconds(::kBackendDefaultTimeout))
      .def_readwrite("chunk_bytes", &O::chunk_bytes, "ODC_CHUNK_BYTES (0: 1 MiB CPU, 32 MiB CUDA)")
      .def_readwrite("ring_slots", &O::ring_slots, "ODC_RING_SLOTS")
      .def_readwrite("reduce_blocks", &O::reduce_blocks, "ODC_REDUCE_BLOCKS")
      .def_readwrite("accumulate_blocks", &O::accumulate_blocks, "ODC_ACCUMULATE_BLOCKS")
      .def_readwrite("small_op_bytes", &O::small_op_bytes, "ODC_SMALL_OP_BYTES (0: no fused op)")
      .def_readwrite("fused_blocks", &O::fused_blocks, "ODC_FUSED_BLOCKS")
      .def_readwrite("stream_memops", &O::stream_memops, "ODC_STREAM_MEMOPS")
      .def_readwrite("ag_push", &O::ag_push, "ODC_AG_PUSH (-1: auto)")
      .def_readwrite("staged_ag_push", &O::staged_ag_push, "ODC_STAGED_AG_PUSH")
      .def_readwrite("zero_copy", &O::zero_copy, "ODC_ZERO_COPY")
      .def_readwrite("transport", &O::transport, "ODC_TRANSPORT")
      .def_readwrite("host_size", &O::host_size, "ODC_HOST_SIZE (0: hosts by name only)")
      .def("splits_hosts", &O::splits_hosts, py::arg("global_a"), py::arg("global_b"),
           "Whether ODC_HOST_SIZE puts these global ranks on different hosts.")
      .def_readwrite("match_check", &O::match_check, "ODC_MATCH_CHECK")
      .def_readwrite("self_serve", &O::self_serve, "ODC_SELF_SERVE")
      .def_readwrite("nccl_available", &O::nccl_available, "whether torch has NCCL")
      .def_readwrite("nvshmem_stage_always", &O::nvshmem_stage_always,
                     "ODC_NVSHMEM_STAGE=always")
      .def_readwrite("pool_bytes", &O::pool_bytes,
                     "ODC_POOL_BYTES (0: 64 MiB CPU, 8 GiB CUDA)")
      .def("pool_bytes_for", &O::pool_bytes_for, py::arg("cuda"),
           "The most registered memory per rank on CUDA (True) or CPU (False): pool_bytes or the default.")
      .def("chunk_bytes_for", &O::chunk_bytes_for, py::arg("cuda"),
           "Bytes per ring slot on CUDA (True) or CPU (False): chunk_bytes or the default.")
      .def("routes_peer", &O::routes_peer, py::arg("global_a"), py::arg("global_b"),
           "Whether CUDA traffic between these global ranks goes over NVSHMEM.")
      .def("routes_some_peer", &O::routes_some_peer, py::arg("global_ranks"),
           "Whether a group of these global ranks reaches some CUDA peer over NVSHMEM.")
      .def("uses_nvshmem", &O::uses_nvshmem, py::arg("global_ranks"),
           "Whether such a group's CUDA windows live in NVSHMEM's heap.")
      .def("clone", &O::copy)
      .def("__copy__", [](const O& o) { return o.copy(); })
      .def("__deepcopy__", [](const O& o, const py::dict&) { return o.copy(); });
}

// The backend: made by _backend.py's creator, with its statistics, arenas and claims.
void bind_backend(BackendClass& backend) {
  using O = odc::Options;
  backend
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       c10::intrusive_ptr<O> options, py::object inner_factory,
                       py::object on_split) {
             using Store = c10::intrusive_ptr<c10d::Store>;
             return c10::make_intrusive<odc::OdcBackend>(
                 store, rank, size, std::move(options),
                 wrap_python<c10::intrusive_ptr<c10d::Backend>, const Store&, int, int,
                             const c10::intrusive_ptr<O>&, const std::string&>(
                     std::move(inner_factory)),
                 wrap_python<void, const c10::intrusive_ptr<odc::OdcBackend>&>(std::move(on_split)));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("options"),
           py::arg("inner_factory"), py::arg("on_split") = py::none())
      .def_property_readonly(
          "options",
          [](odc::OdcBackend& b) {
            return c10::static_intrusive_pointer_cast<odc::Options>(b.getBackendOptions());
          },
          "This group's options (c10d's split_group deep-copies them).")
      .def(
          "perform_nocolor_split", [](odc::OdcBackend&, const c10::Device&) {},
          py::arg("device"),
          "Called by c10d on the ranks outside a new group created from this one: nothing to "
          "do, an odc group needs no collective set-up from non-members.")
      .def("global_ranks", &odc::OdcBackend::global_ranks,
           "This group's ranks in the default group.")
      .def("stats", &odc::OdcBackend::stats,
           "Counters of this group: one-sided ops and bytes, delegated ops.")
      .def("hosts", &odc::OdcBackend::hosts, py::arg("device"),
           py::call_guard<py::gil_scoped_release>(),
           "Where the group's ranks are on several hosts that odc does not connect on `device` "
           "(its collectives then go to the inner NCCL / gloo group); '' where odc connects "
           "them. Sets the device's transport up at the first call (collective).")
      .def("claim", &odc::OdcBackend::claim, py::arg("key"), py::arg("amount") = 1,
           py::call_guard<py::gil_scoped_release>(),
           "The group-wide counter `key` before adding `amount` (atomic; odc.balance's work sharing).")
      .def("forget", &odc::OdcBackend::forget, py::arg("key"),
           py::call_guard<py::gil_scoped_release>(), "Drop the group-wide counter `key`.")
      .def("publish", &odc::OdcBackend::publish, py::arg("key"), py::arg("value"),
           py::call_guard<py::gil_scoped_release>(), "Set the group-wide value `key` (a string).")
      .def("lookup", &odc::OdcBackend::lookup, py::arg("key"),
           py::call_guard<py::gil_scoped_release>(),
           "The group-wide value `key`, waiting for it up to the group's timeout.")
      .def(
          "create_arena",
          [](const c10::intrusive_ptr<odc::OdcBackend>& self, const c10::Device& device,
             const std::vector<int64_t>& shard_numel, const std::vector<int64_t>& param_elem_size,
             const std::vector<int64_t>& grad_numel) {
            return odc::DecoupledArena::create(self, device, shard_numel, param_elem_size,
                                               grad_numel);
          },
          py::arg("device"), py::arg("shard_numel"), py::arg("param_elem_size"),
          py::arg("grad_numel"), py::call_guard<py::gil_scoped_release>(),
          "Decoupled mode: create an arena on `device` (collective): per parameter group its "
          "shard elements, parameter element size and accumulator elements.")
      .def(
          "inner",
          [](odc::OdcBackend& self, const std::string& device) {
            return self.inner(device == "cuda" ? c10::kCUDA : c10::kCPU);
          },
          py::arg("device"), py::call_guard<py::gil_scoped_release>(),
          "The inner backend that takes this group's delegated collectives on a device type.");
}

void bind_arena(BackendClass& backend) {
  // Decoupled mode's arena: it holds its backend, whose transport holds its memory.
  using A = odc::DecoupledArena;
  py::class_<A, std::shared_ptr<A>>(backend, "Arena",
                                    "Decoupled mode's arena (OdcBackend.create_arena).")
      .def("publish", &A::publish, py::arg("group"), py::arg("shard"),
           py::call_guard<py::gil_scoped_release>())
      .def("announce", &A::announce, py::arg("epoch"), py::call_guard<py::gil_scoped_release>())
      .def("get", &A::get, py::arg("group"), py::arg("out"), py::arg("epoch"),
           py::call_guard<py::gil_scoped_release>())
      .def("accumulate", &A::accumulate, py::arg("group"), py::arg("input"),
           py::call_guard<py::gil_scoped_release>())
      .def("finish", &A::finish, py::arg("epoch"), py::arg("groups_too") = false,
           py::call_guard<py::gil_scoped_release>(),
           "The minibatch's synchronisation (collective).")
      .def("take", &A::take, py::arg("group"), py::arg("out"),
           py::call_guard<py::gil_scoped_release>())
      .def("group_done", &A::group_done, py::arg("group"), py::arg("epoch"),
           py::call_guard<py::gil_scoped_release>(),
           "This rank put everything of `group` for `epoch` (after its accumulates).")
      .def("take_when_done", &A::take_when_done, py::arg("group"), py::arg("out"), py::arg("epoch"),
           py::call_guard<py::gil_scoped_release>(),
           "Take `group`'s accumulator once every rank is done with it for `epoch`.")
      .def("side_stream", &A::side_stream,
           "CUDA: the arena's own stream for early reductions (cudaStream_t as int; 0 on CPU).")
      .def("size", &A::size, "Bytes of its shared layout on each rank.")
      .def("release", &A::release, py::call_guard<py::gil_scoped_release>(),
           "Collective: give the arena's memory back (False: the transport keeps it, NVSHMEM); "
           "every later call on it raises.");
}

// What this build has, and the sizes of the shared-memory layouts.
void bind_build(py::module& m) {
  m.attr("built_with_cuda") = odc::kBuiltWithCuda;

  // Sizes of the shared-memory layouts, for sizing NVSHMEM's slab before groups exist.
  m.attr("default_chunk_bytes_cuda") = odc::kDefaultChunkCuda;
  m.attr("default_ring_slots") = odc::kDefaultSlots;
  m.def(
      "window_bytes",
      [](int world, size_t chunk_bytes, int slots) {
        return odc::WindowLayout(world, chunk_bytes, slots).total;
      },
      py::arg("world"), py::arg("chunk_bytes"), py::arg("slots"));
  m.def(
      "arena_bytes",
      [](int world, const std::vector<size_t>& shard_numel,
         const std::vector<size_t>& param_elem_size, const std::vector<size_t>& grad_numel) {
        TORCH_CHECK_VALUE(shard_numel.size() == param_elem_size.size() &&
                              shard_numel.size() == grad_numel.size(),
                          "odc: arena_bytes: one shard size, element size and gradient size "
                          "per parameter group expected");
        return odc::ArenaLayout(world, shard_numel, param_elem_size, grad_numel).total;
      },
      py::arg("world"), py::arg("shard_numel"), py::arg("param_elem_size"), py::arg("grad_numel"));
  // For tests: what `rank` of a group whose ranks use these GPUs (one label per rank) decides
  // from where the ranks are, with these options (odc::placement_choices).
  m.def(
      "_placement_choices",
      [](const std::vector<std::string>& gpus, int rank, const odc::Options& options) {
        odc::Placement p;
        p.rank = rank;
        for (const auto& g : gpus) p.gpus.emplace_back(g.begin(), g.end());
        p.hosts.assign(gpus.size(), "host");
        p.routed.assign(gpus.size(), false);
        const odc::PlacementChoices c = odc::placement_choices(p, options);
        py::dict d;
        d["shares_device"] = c.shares_device;
        d["own_gpus"] = c.own_gpus;
        d["push_all_gather"] = c.push_all_gather;
        d["ranks_on_gpu"] = p.ranks_on_gpu();  // this rank's own: sizes only its own kernels
        return d;
      },
      py::arg("gpus"), py::arg("rank"), py::arg("options"));
}

void bind_nvshmem(py::module& m) {
#ifdef ODC_WITH_NVSHMEM
  m.attr("built_with_nvshmem") = true;
  // NVSHMEM runtime (torch_odc_backend.nvshmem wraps these).
  m.def("nvshmem_unique_id", [] {
    const auto id = odc::nvshmem::unique_id();
    return py::bytes(reinterpret_cast<const char*>(id.data()), id.size());
  });
  m.def(
      "nvshmem_init",
      [](const py::bytes& id, int global_rank, int world, int device, size_t slab_bytes) {
        const std::string s = id;
        const std::vector<uint8_t> v(s.begin(), s.end());
        py::gil_scoped_release nogil;
        return odc::nvshmem::init(v, global_rank, world, device, slab_bytes);
      },
      py::arg("unique_id"), py::arg("global_rank"), py::arg("world"), py::arg("device"),
      py::arg("slab_bytes") = 0);
  m.def(
      "nvshmem_grow",
      [](size_t bytes) {
        py::gil_scoped_release nogil;
        odc::nvshmem::grow(bytes);
      },
      py::arg("bytes"));
  m.def("nvshmem_stage_bytes", &odc::nvshmem::stage_bytes, py::arg("world"));
  m.def("nvshmem_status", [] {
    const auto s = odc::nvshmem::status();
    py::dict d;
    d["init_status"] = s.init_status;
    d["my_pe"] = s.my_pe;
    d["n_pes"] = s.n_pes;
    d["slab_bytes"] = s.slab_bytes;
    d["slab_used"] = s.slab_used;
    d["segments"] = s.segments;
    d["routed_copies"] = s.routed_copies;
    d["routed_signals"] = s.routed_signals;
    d["staged_copies"] = s.staged_copies;
    d["staged_bytes"] = s.staged_bytes;
    d["network_peers"] = s.network_peers;
    return d;
  });
  m.def(
      "nvshmem_ring_selftest",
      [](size_t bytes, uintptr_t stream) {
        odc::nvshmem::SelfTest r;
        {
          py::gil_scoped_release nogil;
          r = odc::nvshmem::ring_selftest(bytes, reinterpret_cast<void*>(stream));
        }
        py::dict d;
        d["mismatched_bytes"] = r.mismatched_bytes;
        d["next_pe_is_p2p"] = r.next_pe_is_p2p;
        d["put_signal_wait_us"] = r.put_signal_wait_us;
        return d;
      },
      py::arg("bytes"), py::arg("stream"));
#else
  m.attr("built_with_nvshmem") = false;
#endif
}
}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_odc_backend native core";
  py::module::import("torch.distributed");  // registers c10d's Backend and Store types

  BackendClass backend(m, "OdcBackend");
  bind_options(backend);
  bind_backend(backend);
  bind_arena(backend);
  bind_build(m);
  bind_nvshmem(m);
}
