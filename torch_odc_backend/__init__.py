"""torch_odc_backend: the "odc" process-group backend.

Importing this package registers the backend::

    import torch_odc_backend
    dist.init_process_group("cpu:gloo,cuda:odc")   # GPUs; "cpu:odc" for CPU tensors

All-gather and reduce-scatter (what FSDP issues per layer) run one-sidedly:
readers *get* shards from their owners' windows and senders *put* their
contributions into the owners' landing rings, where the owner reduces them.
Every other collective is delegated to an inner gloo (CPU) or NCCL (CUDA) group.
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from . import config
from ._build_check import check as _check_build
_check_build()  # ImportError naming both torch versions when _C was built against another torch
from ._C import OdcBackend, built_with_cuda

__all__ = ["OdcBackend", "backend_stats", "balance", "built_with_cuda", "decouple", "metrics", "sync"]

BACKEND_NAME = "odc"


def _make_inner(store, rank: int, size: int, timeout, group_name: str, global_ranks):
    """Factory for the inner group that takes delegated collectives on a device type."""

    def make(device_type: str):
        prefixed = dist.PrefixStore(f"odc_inner_{device_type}/", store)
        if device_type == "cuda":
            if not dist.is_nccl_available():
                raise RuntimeError("odc: this torch has no NCCL, and odc does not serve this "
                                   "collective on CUDA tensors itself (point-to-point)")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            opts.global_ranks_in_group = list(global_ranks)
            opts.group_name = f"{group_name}:odc_inner"
            return dist.ProcessGroupNCCL(prefixed, rank, size, opts)
        return dist.ProcessGroupGloo(prefixed, rank, size, timeout)

    return make


def _new_backend(store, rank: int, size: int, timeout, group_name: str, global_ranks):
    """The odc backend of one group: what the creator and a split (init_process_group with
    device_id: DeviceMesh, split_group) have in common. The ODC_* knobs are read now."""
    knobs = config.knobs()
    return OdcBackend(
        store,
        rank,
        size,
        timeout,
        group_name,
        _make_inner(store, rank, size, timeout, group_name, global_ranks),
        knobs.chunk_bytes,
        knobs.ring_slots,
        knobs.reduce_blocks,
        knobs.small_op_bytes,
        knobs.stream_memops,
        knobs.accumulate_blocks,
        knobs.transport,
        knobs.host_size,
        list(global_ranks),
        knobs.match_check,
        _new_backend,
        knobs.self_serve,
        dist.is_nccl_available(),
    )


def _create_backend(opts, pg_options):
    """Creator for ``dist.Backend.register_backend(..., extended_api=True)``."""
    config.knobs()  # bad knobs fail here, before anything is set up
    if not dist.is_initialized():  # the default group, being created: every rank passes here
        from . import nvshmem

        # peers routed over NVSHMEM (ODC_TRANSPORT / ODC_HOST_SIZE): bring NVSHMEM up now,
        # world-collectively, with the unique id through this group's store
        nvshmem.init_from_backend(opts.store, opts.group_rank, opts.group_size)
    return _new_backend(opts.store, opts.group_rank, opts.group_size, opts.timeout, opts.group_id,
                        opts.global_ranks_in_group or [])


def _require_eager_module_loading() -> None:
    """Ask CUDA to load every kernel at start-up (CUDA_MODULE_LOADING=EAGER).

    odc's device-side waits spin until a peer's signal lands. Under lazy loading
    (PyTorch's default), the first launch of any kernel may wait for the kernels
    already running; a peer blocked that way before launching the signal we wait
    for makes a cross-rank deadlock (seen on H200: hangs with lazy loading, none
    with eager). The variable only takes effect before CUDA is initialised, so
    import torch_odc_backend before the first CUDA call. ODC_ALLOW_LAZY_LOADING=1
    keeps lazy loading (at that risk).
    """
    if os.environ.get("ODC_ALLOW_LAZY_LOADING") == "1" or not built_with_cuda:
        return
    if torch.cuda.is_initialized():
        if os.environ.get("CUDA_MODULE_LOADING", "LAZY").upper() != "EAGER":
            warnings.warn(
                "torch_odc_backend was imported after CUDA was initialised with lazy module "
                "loading; odc collectives can deadlock. Import it before the first CUDA call "
                "or set CUDA_MODULE_LOADING=EAGER.",
                RuntimeWarning,
                stacklevel=3,
            )
        return
    os.environ["CUDA_MODULE_LOADING"] = "EAGER"


def _register() -> None:
    if BACKEND_NAME.upper() in dist.Backend._plugins:  # re-import: already registered
        return
    dist.Backend.register_backend(
        BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
    )


def backend_stats(group=None, device: str = "cpu") -> dict[str, int]:
    """Counters of the odc backend serving ``group`` (default group) on ``device``."""
    group = group or dist.group.WORLD
    backend = group._get_backend(torch.device(device))
    if not isinstance(backend, OdcBackend):
        raise ValueError(f"the {device} backend of this group is {backend.name()}, not odc")
    return dict(backend.stats())


_require_eager_module_loading()
_register()

from .decoupled import decouple, metrics, sync  # noqa: E402  (decoupled mode)
from . import balance  # noqa: E402  (odc.balance: LB-Micro / LB-Mini planning)
