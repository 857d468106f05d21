"""torch_odc_backend: the "odc" process-group backend.

Importing this package registers the backend::

    import torch_odc_backend
    dist.init_process_group("cpu:gloo,cuda:odc")   # GPUs; "cpu:odc" for CPU tensors

An installed package also registers "odc" at ``import torch`` (a ``torch.backends`` entry
point, ``_torch_odc_backend_autoload``; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns it off),
without importing this package; ``ODC_DEFAULT_BACKEND=cuda`` (or ``cpu``, ``cpu,cuda``)
then makes odc the default backend of those devices, for code that never names a backend.

All-gather and reduce-scatter (what FSDP issues per layer) run one-sidedly:
readers *get* shards from their owners' windows and senders *put* their
contributions into the owners' landing rings, where the owner reduces them.
Every other collective is delegated to an inner gloo (CPU) or NCCL (CUDA) group, or
served by odc itself where that cannot (ranks sharing a GPU).

The import stays light (registration only): the compiled core, decoupled mode and
balancing load on first use, where a build for another torch fails with an ImportError
that says how to rebuild.
"""
from __future__ import annotations

import importlib
import os
import warnings

import torch

__all__ = ["OdcBackend", "backend_stats", "balance", "built_with_cuda", "decouple", "last_microbatch",
           "metrics", "release", "restore", "sync", "use_registered_memory"]

from _torch_odc_backend_autoload import BACKEND_NAME  # noqa: E402 - "odc", named once

# name -> (module, attribute or None for the module itself), imported on first access
_LAZY = {
    "OdcBackend": ("._C", "OdcBackend"),
    "built_with_cuda": ("._C", "built_with_cuda"),
    "backend_stats": ("._backend", "backend_stats"),
    "decouple": (".decoupled", "decouple"),
    "sync": (".decoupled", "sync"),
    "last_microbatch": (".decoupled", "last_microbatch"),
    "release": (".decoupled", "release"),
    "restore": (".decoupled", "restore"),
    "metrics": (".decoupled", "metrics"),
    "balance": (".balance", None),
    "nvshmem": (".nvshmem", None),
    "use_registered_memory": (".registered", "use_registered_memory"),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    if module == "._C":
        importlib.import_module("._core", __name__)  # checks the build before loading _C
    mod = importlib.import_module(module, __name__)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


def _create_backend(opts, pg_options):
    """Creator for ``dist.Backend.register_backend(..., extended_api=True)``."""
    from _torch_odc_backend_autoload import check_knobs

    check_knobs()  # a bad ODC_DEFAULT_BACKEND fails the first group, naming the value
    from ._backend import create_backend

    _require_eager_module_loading()  # says what to do if CUDA is up with lazy loading
    return create_backend(opts, pg_options)


def _require_eager_module_loading() -> None:
    """Ask CUDA to load every kernel at start-up (CUDA_MODULE_LOADING=EAGER).

    odc's device-side waits spin until a peer's signal lands. Under lazy loading
    (PyTorch's default), the first launch of any kernel may wait for the kernels
    already running; a peer blocked that way before launching the signal we wait
    for makes a cross-rank deadlock (seen on H200: hangs with lazy loading, none
    with eager). The variable only takes effect before CUDA is initialised, so
    import torch_odc_backend before the first CUDA call (or set the variable, or
    ODC_DEFAULT_BACKEND=cuda, which sets it at ``import torch``).
    ODC_ALLOW_LAZY_LOADING=1 keeps lazy loading (at that risk).
    """
    from . import config  # light: the compiled core loads on first use, not here

    if config.allow_lazy_loading() or torch.version.cuda is None:
        return
    if os.environ.get("CUDA_MODULE_LOADING", "").upper() == "EAGER":
        return
    if torch.cuda.is_initialized():
        warnings.warn(
            "torch_odc_backend: CUDA was initialised with lazy module loading; odc collectives "
            "can deadlock. Import torch_odc_backend before the first CUDA call, or set "
            "CUDA_MODULE_LOADING=EAGER (ODC_DEFAULT_BACKEND=cuda also sets it) in the "
            "environment.",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    os.environ["CUDA_MODULE_LOADING"] = "EAGER"


def _setup() -> None:
    # register: also what `import torch` ran, if it did
    from _torch_odc_backend_autoload import register

    register(_create_backend)  # (a bad ODC_DEFAULT_BACKEND: the first group raises it)
    _require_eager_module_loading()


_setup()
