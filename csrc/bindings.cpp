// Python bindings: the OdcBackend class (a c10d Backend) and build facts.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "backend.hpp"
#ifdef ODC_WITH_NVSHMEM
#include "nvshmem_runtime.hpp"
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

// Wrap a Python callable returning a backend so C++ may call it (and drop it) from any
// thread.
template <typename... Args>
std::function<c10::intrusive_ptr<c10d::Backend>(Args...)> wrap_factory(py::object fn) {
  if (fn.is_none()) return nullptr;
  std::shared_ptr<py::object> holder(new py::object(std::move(fn)), [](py::object* o) {
    // Taking the GIL while the interpreter finalizes ends the thread from inside this
    // destructor (std::terminate); then leaking the reference is the only safe choice.
    if (Py_IsInitialized() && !python_finalizing()) {
      py::gil_scoped_acquire gil;
      delete o;
    }
  });
  return [holder](Args... args) {
    py::gil_scoped_acquire gil;
    return (*holder)(args...).template cast<c10::intrusive_ptr<c10d::Backend>>();
  };
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_odc_backend native core";
  py::module::import("torch.distributed");  // registers c10d's Backend and Store types

  py::class_<odc::OdcBackend, c10d::Backend, c10::intrusive_ptr<odc::OdcBackend>> backend(
      m, "OdcBackend");
  py::class_<odc::OdcOptions, c10d::Backend::Options, c10::intrusive_ptr<odc::OdcOptions>>(
      backend, "Options", "odc's backend options (c10d's split_group copies them)")
      .def(py::init<>())
      .def("__copy__", [](const odc::OdcOptions& o) { return c10::make_intrusive<odc::OdcOptions>(o); })
      .def("__deepcopy__", [](const odc::OdcOptions& o, const py::dict&) {
        return c10::make_intrusive<odc::OdcOptions>(o);
      });
  backend
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, std::string group_name,
                       py::object inner_factory, size_t chunk_bytes, int ring_slots,
                       int reduce_blocks, int64_t small_op_bytes, bool stream_memops,
                       int accumulate_blocks, int transport, int host_size,
                       std::vector<int> global_ranks, bool match_check, py::object split_factory,
                       int self_serve, bool nccl_available, bool nvshmem_stage_always) {
             odc::Knobs k{chunk_bytes,    ring_slots,    reduce_blocks, accumulate_blocks,
                          small_op_bytes, stream_memops, transport,     host_size,
                          std::move(global_ranks), match_check, self_serve, nccl_available,
                          nvshmem_stage_always};
             return c10::make_intrusive<odc::OdcBackend>(
                 store, rank, size, timeout, std::move(group_name),
                 wrap_factory<const std::string&>(std::move(inner_factory)), k,
                 wrap_factory<const c10::intrusive_ptr<c10d::Store>&, int, int,
                              std::chrono::milliseconds, const std::string&,
                              const std::vector<int>&>(std::move(split_factory)));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           py::arg("group_name"), py::arg("inner_factory"), py::arg("chunk_bytes") = 0,
           py::arg("ring_slots") = 0, py::arg("reduce_blocks") = 0,
           py::arg("small_op_bytes") = -1, py::arg("stream_memops") = false,
           py::arg("accumulate_blocks") = 0, py::arg("transport") = 0, py::arg("host_size") = 0,
           py::arg("global_ranks") = std::vector<int>{}, py::arg("match_check") = true,
           py::arg("split_factory") = py::none(), py::arg("self_serve") = 2,
           py::arg("nccl_available") = true, py::arg("nvshmem_stage_always") = false)
      .def_property_readonly(
          "options",
          [](odc::OdcBackend& b) {
            return c10::static_intrusive_pointer_cast<odc::OdcOptions>(b.getBackendOptions());
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
      .def("arena_create", &odc::OdcBackend::arena_create, py::arg("device"),
           py::arg("shard_numel"), py::arg("param_elem_size"), py::arg("grad_numel"),
           py::call_guard<py::gil_scoped_release>(),
           "Decoupled mode: create an arena (collective); returns its id.")
      .def("arena_publish", &odc::OdcBackend::arena_publish, py::arg("arena"), py::arg("group"),
           py::arg("shard"), py::call_guard<py::gil_scoped_release>())
      .def("arena_announce", &odc::OdcBackend::arena_announce, py::arg("arena"),
           py::arg("epoch"), py::call_guard<py::gil_scoped_release>())
      .def("arena_get", &odc::OdcBackend::arena_get, py::arg("arena"), py::arg("group"),
           py::arg("out"), py::arg("epoch"), py::call_guard<py::gil_scoped_release>())
      .def("arena_accumulate", &odc::OdcBackend::arena_accumulate, py::arg("arena"),
           py::arg("group"), py::arg("input"), py::call_guard<py::gil_scoped_release>())
      .def("arena_finish", &odc::OdcBackend::arena_finish, py::arg("arena"), py::arg("epoch"),
           py::call_guard<py::gil_scoped_release>(),
           "Decoupled mode: the minibatch's synchronisation (collective).")
      .def("arena_take", &odc::OdcBackend::arena_take, py::arg("arena"), py::arg("group"),
           py::arg("out"), py::call_guard<py::gil_scoped_release>())
      .def("arena_size", &odc::OdcBackend::arena_size, py::arg("arena"))
      .def(
          "inner",
          [](odc::OdcBackend& self, const std::string& device) {
            return self.inner(device == "cuda" ? c10::kCUDA : c10::kCPU);
          },
          py::arg("device"), py::call_guard<py::gil_scoped_release>(),
          "The inner backend that takes this group's delegated collectives on a device type.");

#ifdef ODC_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif

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
