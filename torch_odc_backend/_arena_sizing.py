"""How big decoupled mode's arena is: per FSDP parameter group, the shard each rank publishes
and the fp32 accumulator it owns, and in all the bytes ``odc.decouple`` will register. Apart
from decoupled mode, so that NVSHMEM's slab can be sized for a model before any group or arena
exists without the two modules importing each other."""
from __future__ import annotations

import dataclasses

import torch
from torch.distributed.fsdp import FSDPModule

from . import _fsdp_adapter
from ._core import _C


def _shard_sizes(policy: _fsdp_adapter.GroupPolicy):
    """Per parameter: padded shard elements and trainability; in all: one rank's packed shard
    (FSDP's all-gather input) and its trainable part (FSDP's reduce-scatter output)."""
    padded = [int(torch.Size(s).numel()) for s in policy.padded_shard_sizes]
    trainable = [p.requires_grad for p in policy.params]
    return padded, trainable, sum(padded), sum(n for n, t in zip(padded, trainable) if t)


def _policies(model: torch.nn.Module) -> list:
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("odc.decouple: the model has no fully_shard modules")
    return [(m, pol) for m in modules if (pol := _fsdp_adapter.group_policy(m)) is not None]


@dataclasses.dataclass
class ArenaPlan:
    """What decoupled mode reads from a fully_shard model, once: its parameter groups (FSDP
    module, policy), their mesh, and per group the arena's shard elements, param-dtype element
    size and accumulator elements."""
    groups: list
    mesh: object
    sizes: tuple

    def bytes(self) -> int:
        """The arena's bytes on each rank (its shared layout)."""
        return int(_C.arena_bytes(self.mesh.size(self.mesh.ndim - 1), *self.sizes))


def plan_arena(model: torch.nn.Module, accumulate: str) -> ArenaPlan:
    return plan_of_groups(_policies(model), accumulate)


def plan_of_groups(groups: list, accumulate: str) -> ArenaPlan:
    """The plan of groups already read (``_policies``)."""
    if accumulate not in ("owner", "local"):
        raise ValueError(f"odc arena_bytes: accumulate must be 'owner' or 'local', got {accumulate!r}")
    mesh = groups[0][1].params[0].device_mesh
    return ArenaPlan(groups, mesh, _arena_sizes([pol for _, pol in groups], accumulate))


def arena_bytes(model: torch.nn.Module, accumulate: str = "owner") -> int:
    """Bytes of the shared arena ``odc.decouple(model, ..., accumulate=accumulate)`` creates on
    each rank: every group's published shard in the param dtype, plus its fp32 accumulator
    with ``"owner"``. Call after fully_shard (sizes NVSHMEM's slab before any group exists)."""
    return plan_arena(model, accumulate).bytes()


def _arena_sizes(policies, accumulate: str):
    """Per group, what the arena holds: shard elements, param-dtype element size, and the
    accumulator's elements (none with accumulate="local")."""
    numel, elem, grad = [], [], []
    for pol in policies:
        _, _, n, g = _shard_sizes(pol)
        numel.append(n)
        elem.append(torch.empty(0, dtype=pol.param_dtype or pol.params[0].dtype).element_size())
        grad.append(g if accumulate == "owner" else 0)
    return numel, elem, grad
