"""Test-only: lets torchtitan (which trains on accelerators only) run on CPU, so that CI,
which has no GPU, can run its unmodified trainer on odc against gloo.

Put this folder first on the PYTHONPATH of torchtitan's ranks (Python imports
``sitecustomize`` at start-up). It changes nothing in torchtitan; it changes what
torchtitan sees:
- the available device type is "cpu" (torchtitan/tools/utils.py takes its device type from
  ``torch._utils._get_available_device_type() or "cuda"``, and its device module from
  ``torch._utils._get_device_module``, i.e. ``torch.cpu``);
- ``torch.cpu`` gets the few calls torchtitan makes on its device module that only
  accelerators have (device name and properties, memory statistics, empty_cache) as
  harmless stand-ins, and ``current_device()`` answers 0, as accelerators number devices;
- where triton is not installed (CPU wheels of torch come without it), torchtitan's MoE
  triton kernels module (``torchtitan.models.moe.kernels``, imported at start-up, used only
  by MoE models) is served as a stand-in whose function raises; the dense debug model
  never calls it.
"""
import atexit
import gc
import importlib.abc
import importlib.util
import sys
import types

import torch
import torch._utils

atexit.register(gc.freeze)  # as tests/integrations/fast_exit/sitecustomize.py, which this one shadows

_device_module = torch._utils._get_device_module
torch._utils._get_available_device_type = lambda: "cpu"
torch._utils._get_device_module = lambda device_type=None: (
    torch.cpu if device_type in (None, "cpu") else _device_module(device_type))

_cpu = torch.cpu
_cpu.current_device = lambda: 0
_cpu.get_device_name = lambda *a, **k: "cpu"
_cpu.get_device_properties = lambda *a, **k: types.SimpleNamespace(name="cpu", total_memory=1 << 36)
_cpu.get_device_capability = lambda *a, **k: (0, 0)
_cpu.memory_stats = lambda *a, **k: {"active_bytes.all.peak": 0, "active_bytes.all.current": 0,
                                     "reserved_bytes.all.peak": 0, "num_alloc_retries": 0,
                                     "num_ooms": 0}
_cpu.reset_peak_memory_stats = lambda *a, **k: None
_cpu.empty_cache = lambda *a, **k: None



class _MoEKernelsStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    NAME = "torchtitan.models.moe.kernels"

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname == self.NAME else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        def generate_permute_indices(*args, **kwargs):
            raise NotImplementedError("torchtitan's MoE triton kernels need triton (CPU shim)")

        module.generate_permute_indices = generate_permute_indices


if importlib.util.find_spec("triton") is None:
    sys.meta_path.insert(0, _MoEKernelsStandIn())
