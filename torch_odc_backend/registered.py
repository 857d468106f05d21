"""Registered memory: zero-copy all-gathers and reduce-scatters.

odc's backend hands out tensors from a pool of memory every peer has mapped
(``allocate_tensor``, the hook c10d defines for it). An all-gather or reduce-scatter whose
input lies there is read by the peers where it lies: nothing is staged through the
window's rings. FSDP2 allocates its communication buffers through that hook when asked to;
``use_registered_memory(model)`` asks every FSDP2 module of a model.

The ranks must allocate the same sizes in the same order (FSDP2 does): each peer's buffer
is found at the same place of that peer's pool, and the collectives check that it is. The
pool grows to what the buffers in use at once need, up to ``ODC_POOL_BYTES``
(docs/configuration.md); beyond that it hands out ordinary memory, and those collectives
take the staged path.

``ODC_FSDP_REGISTERED_MEMORY=auto`` (GPUs) or ``1`` does what ``use_registered_memory`` does
for every FSDP2 module whose collectives run on odc, with no call from the trainer
(``watch_fsdp_modules``).
"""
from __future__ import annotations

import torch

__all__ = ["use_registered_memory"]

_WATCH: dict = {}  # ODC_FSDP_REGISTERED_MEMORY: PyTorch's global hooks, while they watch


def use_registered_memory(model: torch.nn.Module, enable: bool = True) -> int:
    """Make every FSDP2 module in ``model`` allocate its all-gather and reduce-scatter buffers
    from its process group (``FSDPModule.set_allocate_memory_from_process_group_for_comm``):
    under odc, registered memory, so those collectives run zero-copy. Returns how many FSDP2
    modules were set; ``ValueError`` when there is none (call ``fully_shard`` first)."""
    from torch.distributed.fsdp import FSDPModule

    n = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_allocate_memory_from_process_group_for_comm(enable)
            n += 1
    if n == 0:
        raise ValueError("use_registered_memory: the model has no FSDP2 module; call "
                         "torch.distributed.fsdp.fully_shard on it (and its blocks) first")
    return n


def watch_fsdp_modules(device_types: tuple[str, ...] = ("cpu", "cuda")) -> None:
    """``ODC_FSDP_REGISTERED_MEMORY`` (called as an odc group is made): at its first forward,
    before FSDP2 allocates anything for it, every FSDP2 module on one of ``device_types``
    whose all-gathers and reduce-scatters run on odc with FSDP2's default communication takes
    its buffers from registered memory, as after ``use_registered_memory``. PyTorch's public
    global forward pre-hook finds the modules; it and the optimizer-step hook that removes it
    go at the first optimizer step, so later forwards pay nothing (a model first run after
    that keeps the staged path unless ``use_registered_memory`` is called). Idempotent."""
    if _WATCH:
        return
    from torch.distributed.fsdp import FSDPModule
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from . import _fsdp_adapter
    from .config import OdcBackend

    seen: set[int] = set()

    def before_forward(module, args):
        if not isinstance(module, FSDPModule) or id(module) in seen:
            return
        for m in module.modules():
            if isinstance(m, FSDPModule) and id(m) not in seen:
                seen.add(id(m))
                if _fsdp_adapter.default_comms_on(m, OdcBackend, device_types):
                    m.set_allocate_memory_from_process_group_for_comm(True)

    def after_step(optimizer, args, kwargs):
        for handle in _WATCH.values():
            handle.remove()
        _WATCH.clear()

    _WATCH["forward"] = torch.nn.modules.module.register_module_forward_pre_hook(before_forward)
    _WATCH["step"] = register_optimizer_step_post_hook(after_step)
