"""What ``import torch`` runs for torch_odc_backend (its ``torch.backends`` entry point,
PyTorch >= 2.5; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns it off).

It registers the "odc" backend, and with ``ODC_DEFAULT_BACKEND`` makes odc the default
backend of the named device types, without importing the package: the package (and its
compiled core) loads when a group is created. So ``import torch`` stays as fast as it
was, and the user's own ``import torch_odc_backend`` keeps meaning "this process uses
odc" (it then asks CUDA for eager module loading, which odc needs, if CUDA is not up yet;
ODC_DEFAULT_BACKEND with cuda asks for it here). A bad knob or a broken install must not
break ``import torch`` for the user's other work: a broken install is one warning here. A bad
ODC_DEFAULT_BACKEND is silent here, since every process that imports torch runs this hook
(torchrun's launcher too), and so is ``import torch_odc_backend``: the one message is the
error the first process group raises, where the value takes effect (check_knobs).
"""
from __future__ import annotations

import os
import warnings

BACKEND_NAME = "odc"


def default_backend_devices() -> list[str]:
    """ODC_DEFAULT_BACKEND: the device types whose default backend becomes odc ("cuda",
    "cpu" or "cpu,cuda"); unset or empty: none (PyTorch's defaults stay)."""
    raw = os.environ.get("ODC_DEFAULT_BACKEND", "").strip().lower()
    devices = [d.strip() for d in raw.split(",") if d.strip()]
    bad = [d for d in devices if d not in ("cpu", "cuda")]
    if bad:
        raise ValueError(f"ODC_DEFAULT_BACKEND={raw!r}: expected cuda, cpu or cpu,cuda")
    return devices


# A bad ODC_DEFAULT_BACKEND, kept for the first odc group to raise (check_knobs).
_knob_error: ValueError | None = None


def check_knobs() -> None:
    """Raise the error of a bad ODC_DEFAULT_BACKEND (called by the backend's creator)."""
    if _knob_error is not None:
        raise ValueError(str(_knob_error))


def _create(opts, pg_options):
    """The registered creator: the package loads with the first odc group (its creator
    raises a bad ODC_DEFAULT_BACKEND first: check_knobs)."""
    import torch_odc_backend

    return torch_odc_backend._create_backend(opts, pg_options)


def register(creator=_create) -> list[str]:
    """Register "odc" (unless it is) and apply ODC_DEFAULT_BACKEND through PyTorch's public
    Backend.default_device_backend_map, which init_process_group() without a backend,
    init_device_mesh without a group and trainers that derive a backend from it use.
    Returns the devices switched.

    A bad value still registers odc, and makes it the default of every device: the first
    group then fails naming the variable and its value, where leaving PyTorch's defaults
    would run the job on another backend without a word."""
    global _knob_error
    import torch.distributed as dist

    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, creator, extended_api=True, devices=["cpu", "cuda"])
    try:
        devices = default_backend_devices()
        _knob_error = None
    except ValueError as e:
        _knob_error = e
        devices = ["cpu", "cuda"]
    for device in devices:
        dist.Backend.default_device_backend_map[device] = BACKEND_NAME
    return devices


def autoload() -> None:
    try:
        devices = register()  # a bad ODC_DEFAULT_BACKEND: silent here (the first group raises it)
        if "cuda" in devices and os.environ.get("ODC_ALLOW_LAZY_LOADING") != "1":
            os.environ["CUDA_MODULE_LOADING"] = "EAGER"  # before CUDA starts: odc needs it
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"torch_odc_backend was not set up at `import torch` ({type(e).__name__}: {e}); "
                      f"`import torch_odc_backend` raises the error", RuntimeWarning)
