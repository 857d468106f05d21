"""The odc backend's creation: what ``init_process_group``, ``new_group`` and a split call.

Loaded on first use (the package's import stays light, as ``import torch`` imports it
through the ``torch.backends`` entry point): it loads the compiled ``_C`` after checking
that it was built for the running torch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import config
from .config import OdcBackend


def _make_inner(store, rank: int, size: int, options, device_type: str):
    """A group's inner backend for a device type, which takes the collectives odc delegates:
    gloo for "cpu", NCCL for "cuda" (the C++ backend calls it with the group's store, rank,
    size and options, for a group made here and for every group split from it)."""
    prefixed = dist.PrefixStore(f"odc_inner_{device_type}/", store)
    if device_type == "cuda":
        if not dist.is_nccl_available():
            raise RuntimeError("odc: this torch has no NCCL, and odc does not serve this "
                               "collective on CUDA tensors itself (point-to-point)")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = options._timeout
        opts.global_ranks_in_group = list(options.global_ranks_in_group)
        opts.group_name = f"{options.group_name}:odc_inner"
        return dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    return dist.ProcessGroupGloo(prefixed, rank, size, options._timeout)


_STATS: list[tuple[dict, OdcBackend]] = []  # ODC_STATS_DIR: the groups whose counters go out at exit


def _write_stats_at_exit() -> None:
    """ODC_STATS_DIR: write this process's odc groups and their counters (after the trainer
    destroyed them: the counters stay readable) to ``odc_stats_rank<R>.json``."""
    import json
    import os

    folder = config.stats_dir()
    if not _STATS or not folder:
        return
    try:
        groups = [dict(info, stats={k: int(v) for k, v in dict(b.stats()).items()}) for info, b in _STATS]
        rank = next((info["rank"] for info in groups if info["default"]), groups[0]["rank"])
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"odc_stats_rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "odc_default_backend": config.default_backend_as_set(),
                       "groups": groups}, f, indent=1)
    except Exception as e:  # noqa: BLE001 - a report must never turn a finished run into a failure
        import sys

        print(f"odc: ODC_STATS_DIR={folder!r}: could not write the counters there: {e!r}",
              file=sys.stderr)
    finally:
        _STATS.clear()  # the backends go now, while the interpreter is whole


def _check_stats_dir(folder: str) -> None:
    """ODC_STATS_DIR must be a folder this process can create and write: say so at the first
    group rather than lose the counters at exit."""
    import os

    try:
        os.makedirs(folder, exist_ok=True)
        writable = os.access(folder, os.W_OK)
    except OSError as e:
        raise ValueError(f"ODC_STATS_DIR={folder!r}: cannot create that folder ({e.strerror or e})") from None
    if not writable:
        raise ValueError(f"ODC_STATS_DIR={folder!r}: this process cannot write to that folder")


def _keep_stats(backend, default: bool) -> None:
    """ODC_STATS_DIR: remember the group, to write its counters at exit."""
    folder = config.stats_dir()
    if not folder:
        return
    _check_stats_dir(folder)
    if not _STATS:
        import atexit

        atexit.register(_write_stats_at_exit)
    options = backend.options
    _STATS.append(({"group_name": options.group_name, "rank": dist.get_rank() if dist.is_initialized() else backend.rank(),
                    "group_rank": backend.rank(), "size": backend.size(), "default": default,
                    "ranks": list(options.global_ranks_in_group)}, backend))


def _new_backend(store, rank: int, size: int, options):
    """The odc backend of one group with these options. Groups split from it (DeviceMesh,
    split_group) are made by the C++ backend itself, with the same inner-backend factory."""
    on_split = (lambda b: _keep_stats(b, default=False)) if config.stats_dir() else None
    backend = OdcBackend(store, rank, size, options, _make_inner, on_split)
    # the default group is the one being created before the world is initialised
    _keep_stats(backend, default=not dist.is_initialized())
    return backend


def create_backend(opts, pg_options):
    """The registered creator's work (``dist.Backend.register_backend(..., extended_api=True)``)."""
    options = config.options_from_env(opts.timeout, opts.group_id, opts.global_ranks_in_group or [])
    if not dist.is_initialized():  # the default group, being created: every rank passes here
        from . import nvshmem

        # peers routed over NVSHMEM (ODC_TRANSPORT / ODC_HOST_SIZE): bring NVSHMEM up now,
        # world-collectively, with the unique id through this group's store
        nvshmem.init_from_backend(opts.store, opts.group_rank, opts.group_size, options)
    backend = _new_backend(opts.store, opts.group_rank, opts.group_size, options)
    devices = config.fsdp_registered_devices()
    if devices:
        from .registered import watch_fsdp_modules

        watch_fsdp_modules(devices)
    return backend


def backend_stats(group=None, device: str = "cpu") -> dict[str, int]:
    """Counters of the odc backend serving ``group`` (default group) on ``device``."""
    group = group or dist.group.WORLD
    backend = group._get_backend(torch.device(device))
    if not isinstance(backend, OdcBackend):
        raise ValueError(f"the {device} backend of this group is {backend.name()}, not odc")
    return dict(backend.stats())
