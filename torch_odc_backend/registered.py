"""Registered memory: zero-copy all-gathers and reduce-scatters.

odc's backend hands out tensors from a pool of memory every peer has mapped
(``allocate_tensor``, the hook c10d defines for it). An all-gather or reduce-scatter whose
input lies there is read by the peers where it lies: nothing is staged through the
window's rings. FSDP2 allocates its communication buffers through that hook when asked to;
``use_registered_memory(model)`` asks every FSDP2 module of a model.

The ranks must allocate the same sizes in the same order (FSDP2 does): each peer's buffer
is found at the same place of that peer's pool, and the collectives check that it is.
``ODC_POOL_BYTES`` sizes the pool (docs/configuration.md); a full pool hands out ordinary
memory, and those collectives take the staged path.
"""
from __future__ import annotations

import torch

__all__ = ["use_registered_memory"]


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
