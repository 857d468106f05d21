"""The odc engine's two pieces of plumbing: an odc mesh shaped like verl's, and this rank's
LB-Mini share of a minibatch that verl's data loader spread over the ranks.

A rank's share holds samples that other ranks loaded. With LB-Mini the ranks gather the
samples' lengths only, all compute the same plan from them
(:func:`torch_odc_backend.balance.lb_mini` is deterministic), and each rank sends every other
the samples of its own that the plan gives that rank (one all-to-all of the pickled samples:
each sample travels once). With dynamic balancing a rank may end up training any sample, so
every rank gathers every rank's samples (token ids and masks, small beside the model). The
gradient is a sum over the minibatch's samples, and verl normalises each microbatch's loss by
the minibatch's token count, so who trains which sample does not change the result beyond the
order of summation.
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


def microbatch_of(sources: list, counts: list[int], indices: list[int], positions: dict | None = None):
    """The microbatch (one TensorDict) of these samples, indices into the ranks' concatenation
    (``counts`` samples each). ``sources[r]`` holds rank r's samples: all of them, or with
    ``positions[r]`` (local index -> row) the ones it sent here."""
    parts = [tu.index_select_tensor_dict(sources[owner], local if positions is None
                                         else [positions[owner][i] for i in local])
             for owner, local in split_by_owner(indices, counts)]
    return parts[0] if len(parts) == 1 else tu.concat_tensordict(parts)


def share_of_minibatch(data, *, max_tokens: int, cost: CostModel, group) -> list:
    """This rank's microbatches (TensorDicts) of the minibatch whose local part is ``data``:
    LB-Mini over every rank's samples, each microbatch at most ``max_tokens`` tokens. A rank
    may get none. Collective over ``group`` (every rank calls it once per minibatch)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    lengths = [None] * world
    dist.all_gather_object(lengths, sample_lengths(data), group=group)
    counts = [len(x) for x in lengths]
    plan = lb_mini([n for part in lengths for n in part], world, max_tokens, cost)
    local = data.cpu()
    # to each rank, the samples of mine its microbatches hold (ascending local index)
    outgoing = []
    for rank in range(world):
        mine = _needed(plan[rank], counts).get(me)
        outgoing.append(tu.index_select_tensor_dict(local, mine) if mine else None)
    incoming = _all_to_all_objects(outgoing, group)
    positions = {owner: {i: row for row, i in enumerate(idx)} for owner, idx in _needed(plan[me], counts).items()}
    return [microbatch_of(incoming, counts, indices, positions) for indices in plan[me]]


def _needed(microbatches: list[list[int]], counts: list[int]) -> dict[int, list[int]]:
    """Per owner rank, the local indices (ascending) of its samples in these microbatches."""
    needed: dict[int, set[int]] = {}
    for mb in microbatches:
        for owner, idx in split_by_owner(mb, counts):
            needed.setdefault(owner, set()).update(idx)
    return {owner: sorted(idx) for owner, idx in needed.items()}


def _all_to_all_objects(outgoing: list, group) -> list:
    """``outgoing[r]`` (any picklable object) to rank ``r``; returns what each rank sent here.
    Byte tensors on the CPU: with verl's ``cpu:gloo,cuda:nccl`` group, gloo carries them."""
    import pickle

    import torch

    payloads = [pickle.dumps(obj) for obj in outgoing]
    send_sizes = torch.tensor([len(p) for p in payloads], dtype=torch.int64)
    recv_sizes = torch.empty_like(send_sizes)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    send = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8) if sum(map(len, payloads)) else \
        torch.empty(0, dtype=torch.uint8)
    recv = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8)
    dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes.tolist(),
                           input_split_sizes=send_sizes.tolist(), group=group)
    out, at = [], 0
    for n in recv_sizes.tolist():
        out.append(pickle.loads(recv[at:at + n].numpy().tobytes()))
        at += n
    return out


def claimed_microbatches(data, *, balancer, max_tokens: int, cost: CostModel, group, sp_group=None,
                         sp_leader: int | None = None):
    """Dynamic balancing: this rank's microbatches as it claims them from ``balancer``
    (:class:`torch_odc_backend.balance.DynamicBalancer`) while it trains; a rank that is free
    takes work another has not started. Gathers the minibatch like :func:`share_of_minibatch`.

    With sequence parallelism the ranks of one SP group (``sp_group``) train the same
    microbatches: only its leader (global rank ``sp_leader``, holding ``balancer``; the others
    pass None) claims, over the SP groups, and hands each claim to its SP peers (a broadcast
    over ``sp_group``), then the end of its claims."""
    everyone, counts, flat = gather_minibatch(data, group)
    if sp_group is None:
        for indices in balancer.minibatch(flat, max_tokens, cost):
            yield microbatch_of(everyone, counts, indices)
        return
    if balancer is not None:  # the SP group's leader
        for indices in balancer.minibatch(flat, max_tokens, cost):
            dist.broadcast_object_list([list(indices)], src=sp_leader, group=sp_group)
            yield microbatch_of(everyone, counts, indices)
        dist.broadcast_object_list([None], src=sp_leader, group=sp_group)
        return
    while True:
        claim = [None]
        dist.broadcast_object_list(claim, src=sp_leader, group=sp_group)
        if claim[0] is None:
            return
        yield microbatch_of(everyone, counts, claim[0])
