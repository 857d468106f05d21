"""Test-only: lets Megatron-FSDP (which runs on CUDA only) run on CPU, so that CI, which
has no GPU, can run its sharding, bucketing and coalesced collectives on odc.

Put this folder first on the ranks' PYTHONPATH (Python imports ``sitecustomize`` at
start-up); examples/recipes/megatron_fsdp_train.py then passes ``device=cpu`` to
``fully_shard_model`` (on CUDA it names no device, as Megatron-FSDP's Quick Start). It
changes nothing in megatron_fsdp; it changes what it sees of ``torch.cuda``:
- streams and events (``torch.cuda.Stream``, ``Event``, ``stream``, ``current_stream``,
  ``synchronize``): CPU work is synchronous, so stand-ins whose waits return at once
  (Megatron-FSDP issues its collectives inside side-stream contexts and waits on events
  recorded there: megatron_fsdp.py, param_and_grad_buffer.py);
- ``torch.cuda.current_device()`` answers 0 (megatron_fsdp.py compares its device with
  ``cuda:<current>``), and ``Tensor.cuda()`` stays on CPU;
- ``init_device_mesh("cuda", ...)``, which ``fully_shard_model`` calls when given no mesh
  (fully_shard.py), builds a CPU mesh.
"""
import atexit
import contextlib
import gc

import torch
import torch.distributed.device_mesh as _device_mesh

atexit.register(gc.freeze)  # as tests/integrations/fast_exit/sitecustomize.py, which this one shadows


class _Event:
    def wait(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _Stream:
    def record_event(self, *args, **kwargs):
        return _Event()

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


_current = _Stream()
torch.cuda.Stream = lambda *args, **kwargs: _Stream()
torch.cuda.Event = lambda *args, **kwargs: _Event()
torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
torch.cuda.current_stream = lambda *args, **kwargs: _current
torch.cuda.synchronize = lambda *args, **kwargs: None
torch.cuda.empty_cache = lambda *args, **kwargs: None
torch.cuda.current_device = lambda: 0
torch.Tensor.cuda = lambda self, *args, **kwargs: self

_init_device_mesh = _device_mesh.init_device_mesh


def _init_cpu_mesh(device_type, *args, **kwargs):
    return _init_device_mesh("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


_device_mesh.init_device_mesh = _init_cpu_mesh
