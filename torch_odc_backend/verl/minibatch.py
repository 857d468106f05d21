"""The odc engine's two pieces of plumbing: an odc mesh shaped like verl's, and this rank's
LB-Mini share of a minibatch that verl's data loader spread over the ranks.

A rank's share holds samples that other ranks loaded: every rank gathers every rank's samples
(token ids and masks, small beside the model), all compute the same LB-Mini plan from the same
lengths (:func:`torch_odc_backend.balance.lb_mini` is deterministic), and each builds its
microbatches from it. The gradient is a sum over the minibatch's samples, and verl normalises
each microbatch's loss by the minibatch's token count, so who trains which sample does not
change the result beyond the order of summation.
"""
from __future__ import annotations

from bisect import bisect_right

import torch.distributed as dist
from verl.utils import tensordict_utils as tu

from ..balance import CostModel, lb_mini

__all__ = ["claimed_microbatches", "gather_minibatch", "microbatch_of", "odc_mesh_like", "sample_lengths",
           "share_of_minibatch", "split_by_owner"]


def odc_mesh_like(mesh):
    """A DeviceMesh of ``mesh``'s shape over the same ranks, its groups odc's. Its dimension
    names get an ``odc_`` prefix: meshes of one shape and names compare equal, and FSDP2 could
    then mix this mesh with one of another backend in the same process (a reference model)."""
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(f"odc_{n}" for n in mesh.mesh_dim_names)
    return init_device_mesh(mesh.device_type, tuple(mesh.mesh.shape), mesh_dim_names=names,
                            backend_override={n: "odc" for n in names})


def sample_lengths(data) -> list[int]:
    """Tokens per sample of a verl batch (nested ``input_ids``, or a padded ``attention_mask``)."""
    ids = data["input_ids"]
    if ids.is_nested:
        return ids.offsets().diff().tolist()
    return data["attention_mask"].sum(dim=1).tolist()


def split_by_owner(indices: list[int], counts: list[int]) -> list[tuple[int, list[int]]]:
    """Indices into the ranks' concatenated samples as (owner rank, its local indices), in the
    order of ``indices`` grouped by owner."""
    ends = [sum(counts[:r + 1]) for r in range(len(counts))]  # past each rank's last sample
    by_owner: dict[int, list[int]] = {}
    for i in indices:
        if not 0 <= i < ends[-1]:
            raise IndexError(f"sample {i} of a minibatch of {ends[-1]}")
        owner = bisect_right(ends, i)
        by_owner.setdefault(owner, []).append(i - (ends[owner] - counts[owner]))
    return sorted(by_owner.items())


def gather_minibatch(data, group) -> tuple[list, list[int], list[int]]:
    """Every rank's part of the minibatch (TensorDicts, on the CPU), the number of samples of
    each, and the samples' lengths in rank order. Collective over ``group``."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, data.cpu(), group=group)
    lengths = [sample_lengths(part) for part in everyone]
    return everyone, [len(x) for x in lengths], [n for part in lengths for n in part]


def microbatch_of(everyone: list, counts: list[int], indices: list[int]):
    """The microbatch (one TensorDict) of these samples, indices into the ranks' concatenation."""
    parts = [tu.index_select_tensor_dict(everyone[owner], local)
             for owner, local in split_by_owner(indices, counts)]
    return parts[0] if len(parts) == 1 else tu.concat_tensordict(parts)


def share_of_minibatch(data, *, max_tokens: int, cost: CostModel, group) -> list:
    """This rank's microbatches (TensorDicts) of the minibatch whose local part is ``data``:
    LB-Mini over every rank's samples, each microbatch at most ``max_tokens`` tokens. A rank
    may get none. Collective over ``group`` (every rank calls it once per minibatch)."""
    everyone, counts, flat = gather_minibatch(data, group)
    plan = lb_mini(flat, dist.get_world_size(group), max_tokens, cost)
    return [microbatch_of(everyone, counts, indices) for indices in plan[dist.get_rank(group)]]


def claimed_microbatches(data, *, balancer, max_tokens: int, cost: CostModel, group):
    """Dynamic balancing: this rank's microbatches as it claims them from ``balancer``
    (:class:`torch_odc_backend.balance.DynamicBalancer`) while it trains; a rank that is free
    takes work another has not started. Gathers the minibatch like :func:`share_of_minibatch`."""
    everyone, counts, flat = gather_minibatch(data, group)
    for indices in balancer.minibatch(flat, max_tokens, cost):
        yield microbatch_of(everyone, counts, indices)
