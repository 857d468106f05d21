"""Zero-copy for every CUDA tensor (ODC_ZERO_COPY, on by default): all-gathers and reduce-scatters
of tensors from PyTorch's caching allocator read each rank's input where it lies once every peer
has its segment mapped, and stage it until then (Protocol::all_gather_direct).

Results must be bitwise those of the staged path (ODC_ZERO_COPY=0) whichever way each rank's
input went, with ranks out of step, inputs spanning several staging rounds, memory that cannot be
shared (expandable segments), and segments freed and allocated again between collectives
(empty_cache): a peer must never read a segment through an old mapping. With ODC_AG_PUSH=1
all-gathers push: each rank writes its shard into a peer's output where that peer said it lies
(with the copy engines where its guess of that place holds), and a peer whose output is not
mapped yet reads for itself; both at once within one call must give the same result, and a
rank whose host runs calls ahead of its peers' must still guess where their outputs lie. GPU only.
"""
from __future__ import annotations

import os
import random
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import GPU_ENV, cuda_case, run_distributed

BF16, F32 = torch.bfloat16, torch.float32
# (op, elements per rank, dtype, in place / reduce op): small ones run as the fused kernel,
# 3 M fp32 (12 MB per rank) on the copy engines' located copies and reductions.
CASES = [("ag", 1001, BF16, True), ("ag", 4096, F32, False), ("ag", 0, F32, True),
         ("rs", 1001, F32, dist.ReduceOp.SUM), ("rs", 4096, BF16, dist.ReduceOp.AVG),
         ("rs", 777, F32, dist.ReduceOp.MAX), ("ag", 3_000_000, F32, True),
         ("ag", 3_000_000, BF16, False), ("rs", 3_000_000, F32, dist.ReduceOp.SUM)]


def _device():
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def _inputs(dev, case, seed):
    op, n, dtype, how = case
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(seed + rank)
    if op == "ag":
        out = torch.empty(world * n, dtype=dtype, device=dev)
        inp = out[rank * n:(rank + 1) * n] if how is True else torch.empty(n, dtype=dtype, device=dev)
        inp.copy_(torch.randn(n, generator=g).to(dtype))
        return out, inp
    inp = torch.randn(world * n, generator=g).to(dtype).to(dev)
    return torch.empty(n, dtype=dtype, device=dev), inp


def _call(case, out, inp, group):
    if case[0] == "ag":
        dist.all_gather_into_tensor(out, inp, group=group)
    else:
        dist.reduce_scatter_tensor(out, inp, op=case[3], group=group)


def _in_place(dev, group):
    return dict(group._get_backend(dev).stats()).get("direct_in_place_ops", 0)


def _worker(rank, world, rounds, skew):
    dev = _device()
    os.environ["ODC_ZERO_COPY"] = "0"
    staged = dist.new_group(list(range(world)))  # its options are read now
    os.environ.pop("ODC_ZERO_COPY")
    direct = dist.group.WORLD
    rng = random.Random(rank)
    errors, in_place_late = [], []
    for i, case in enumerate(CASES):
        out, inp = _inputs(dev, case, 1000 * i)
        ref = out.clone()
        _call(case, ref, inp, staged)
        for r in range(rounds):  # the same buffers: staged at first, then in place
            if skew:
                time.sleep(rng.random() * 0.01)  # ranks out of step on the host
            before = _in_place(dev, direct)
            if case[0] == "rs" or case[3] is not True:
                out.fill_(0)  # (in place, the own part is the input)
            _call(case, out, inp, direct)
            torch.cuda.synchronize()
            if not torch.equal(out.view(torch.uint8), ref.view(torch.uint8)):
                errors.append(f"case {case} round {r}: differs from the staged path")
            if r == rounds - 1:
                in_place_late.append(_in_place(dev, direct) - before)
            dist.barrier()
    return errors, in_place_late, dict(direct._get_backend(dev).stats())


@pytest.mark.parametrize("world,skew", [cuda_case(2, False, id="cuda-2"), cuda_case(4, True, id="cuda-4-skewed")])
def test_direct_matches_staged_bitwise(world, skew):
    res = run_distributed(_worker, world, 3, skew, backend="cpu:gloo,cuda:odc", env=dict(GPU_ENV),
                          timeout_s=60, deadline_s=240)
    for rank, (errors, in_place_late, stats) in res.items():
        assert not errors, f"rank {rank}: " + "\n".join(errors)
        # By the third call every peer has mapped the buffers (their second call did): in place,
        # except an empty all-gather (no memory to read).
        assert in_place_late == [0 if c[1] == 0 else 1 for c in CASES], (rank, in_place_late, stats)
        assert stats["direct_ops"] == 3 * len(CASES), (rank, stats)
        assert "direct_pushed_ops" not in stats, (rank, stats)  # reads unless ODC_AG_PUSH=1


def _rounds_worker(rank, world):
    """Inputs of several staging rounds (1 MiB chunks x 2 slots: 2 MiB rounds), staged and in
    place, with buffers freed and the cache emptied between calls."""
    dev = _device()
    os.environ["ODC_ZERO_COPY"] = "0"
    staged = dist.new_group(list(range(world)))
    os.environ.pop("ODC_ZERO_COPY")
    errors = []
    for step in range(6):
        n = [1_300_000, 700_000, 2_100_000][step % 3]  # fp32: 5.2, 2.8, 8.4 MB per rank
        for case in [("ag", n, F32, step % 2 == 0), ("rs", n, F32, dist.ReduceOp.SUM)]:
            out, inp = _inputs(dev, case, 77 * step)
            ref = out.clone()
            _call(case, ref, inp, staged)
            for _ in range(3):  # the third in place: the peers mapped the segments at the second
                _call(case, out, inp, None)
                dist.barrier()  # (host order: every peer's next call starts after this one)
            torch.cuda.synchronize()
            if not torch.equal(out.view(torch.uint8), ref.view(torch.uint8)):
                errors.append(f"step {step} case {case}: differs from the staged path")
            del out, inp, ref
            torch.cuda.empty_cache()  # the segments go back to the driver; new ones may reuse them
    return errors, dict(dist.group.WORLD._get_backend(dev).stats())


@pytest.mark.parametrize("world,alloc_conf", [cuda_case(2, "", id="cuda-2"),
                                              cuda_case(3, "expandable_segments:True", id="cuda-3-expandable")])
def test_rounds_and_freed_segments(world, alloc_conf):
    env = {**GPU_ENV, "ODC_CHUNK_BYTES": "1M", "ODC_RING_SLOTS": "2"}
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    res = run_distributed(_rounds_worker, world, backend="cpu:gloo,cuda:odc", env=env, timeout_s=60,
                          deadline_s=240)
    for rank, (errors, stats) in res.items():
        assert not errors, f"rank {rank}: " + "\n".join(errors)
        if alloc_conf:  # expandable segments cannot be shared through CUDA IPC handles: staged
            assert "direct_in_place_ops" not in stats, (rank, stats)
        else:
            assert stats.get("direct_in_place_ops", 0) > 0, (rank, stats)


def _mixed_outputs_worker(rank, world):
    """Pushed all-gathers where, in every call after the first, half the ranks have an output in
    a new segment (a new memory pool's: not mapped by the peers, so they read for themselves)
    and half reuse theirs (mapped by every peer before the call, so their peers push into it);
    inputs in place and not, of one and of several staging rounds. Returns, per call, whether
    this rank's output was pushed into and whether it was meant to be."""
    dev = _device()
    os.environ["ODC_ZERO_COPY"] = "0"
    staged = dist.new_group(list(range(world)))
    os.environ.pop("ODC_ZERO_COPY")
    pushed = lambda: dict(dist.group.WORLD._get_backend(dev).stats()).get("direct_pushed_ops", 0)
    tiny = torch.zeros(world, device=dev)

    def settle():
        # An operation of the group: each peer maps the segments shared in the last call
        # (SegmentTable::refresh), and the barrier orders that before anyone's next locate.
        dist.all_gather_into_tensor(tiny, tiny[rank:rank + 1])
        torch.cuda.synchronize()
        dist.barrier()

    errors, calls = [], []
    for step in range(4):
        # fp32: 12 MB per rank (7 rounds of 2 MiB; the copy engines) and 1.2 MB (the fused kernel)
        n = [3_000_000, 300_000][step % 2]
        for in_place in (True, False):
            case = ("ag", n, F32, in_place)
            out, inp = _inputs(dev, case, 31 * step + in_place)
            ref = out.clone()
            _call(case, ref, inp, staged)
            pools = []  # alive until the step ends, so no new output lands in a mapped segment
            for k in range(4):
                fresh = (rank + k) % 2 == 0
                if fresh and k:
                    keep = inp.clone() if not in_place else out[rank * n:(rank + 1) * n].clone()
                    pools.append(torch.cuda.MemPool())
                    with torch.cuda.use_mem_pool(pools[-1]):
                        out = torch.empty(world * n, dtype=F32, device=dev)
                        inp = out[rank * n:(rank + 1) * n] if in_place else torch.empty(n, dtype=F32, device=dev)
                    inp.copy_(keep)
                    del keep
                if not in_place:
                    out.fill_(0)
                before = pushed()
                _call(case, out, inp, None)
                torch.cuda.synchronize()
                if k:
                    calls.append((pushed() - before, 0 if fresh else 1))
                if not torch.equal(out.view(torch.uint8), ref.view(torch.uint8)):
                    errors.append(f"step {step} in place {in_place} call {k}: differs from the staged path")
                settle()
            del out, inp, ref
            pools.clear()
            torch.cuda.empty_cache()  # the segments go back to the driver: their ends are told
    errors += _alternating_outputs(dev, staged, world, rank)
    errors += _guesses_from_ahead(dev, world, rank)
    return errors, calls


def _alternating_outputs(dev, staged, world, rank):
    """Rank 1 alternates between two outputs, both mapped by its peers, while theirs stay: a
    peer that guesses where rank 1's output lies from the last call with its own output (the
    other buffer) guesses wrong, unless rank 1 issued the call first; either way the result
    must be exact (a wrong guess is never written to)."""
    errors, n = [], 3_000_000
    outs = [torch.empty(world * n, dtype=F32, device=dev) for _ in range(2 if rank == 1 else 1)]
    inp = torch.randn(n, generator=torch.Generator().manual_seed(5 + rank)).to(dev)
    ref = torch.empty(world * n, dtype=F32, device=dev)
    _call(("ag", n, F32, False), ref, inp, staged)
    for k in range(8):
        out = outs[k % len(outs)]
        out.fill_(0)
        if rank == 1:
            time.sleep(0.002 * (k % 3))  # rank 1 issues first in some calls, last in others
        _call(("ag", n, F32, False), out, inp, None)
        torch.cuda.synchronize()
        if not torch.equal(out.view(torch.uint8), ref.view(torch.uint8)):
            errors.append(f"alternating outputs, call {k}: differs from the staged path")
        dist.barrier()
    return errors


def _guesses_from_ahead(dev, world, rank):
    """Back-to-back pushed all-gathers into one output (the copy engines), rank 0 issuing its
    calls late: the other ranks' hosts run every call before rank 0 published where its output
    lies, so they guess it from the calls they saw before. Every push must be to a guessed place
    and every guess confirmed on the device (the group's stats), on every rank."""
    n, calls = 3_000_000, 12
    stats = lambda: dict(dist.group.WORLD._get_backend(dev).stats())
    out = torch.empty(world * n, dtype=F32, device=dev)
    inp = out[rank * n:(rank + 1) * n]
    inp.copy_(torch.full((n,), float(rank + 1)))
    for _ in range(3):  # every peer maps the output, and sees where it lies
        _call(("ag", n, F32, True), out, inp, None)
        torch.cuda.synchronize()
        dist.barrier()
    before = stats()
    if rank == 0:
        time.sleep(0.2)
    for _ in range(calls):
        _call(("ag", n, F32, True), out, inp, None)
    torch.cuda.synchronize()
    after = stats()
    tally = [after.get(k, 0) - before.get(k, 0) for k in ("guessed_pushes", "guessed_push_hits")]
    errors = []
    if tally != [(world - 1) * calls] * 2:
        errors.append(f"calls issued ahead: pushes to guessed places and confirmed {tally}, "
                      f"expected {(world - 1) * calls} each")
    expected = torch.arange(1, world + 1, dtype=F32, device=dev).repeat_interleave(n)
    if not torch.equal(out, expected):
        errors.append("calls issued ahead: wrong output")
    dist.barrier()
    return errors


@pytest.mark.parametrize("world", [cuda_case(2, gpus=2, id="cuda-2"), cuda_case(4, gpus=4, id="cuda-4")])
def test_pushed_and_read_outputs_in_one_call(world):
    env = {**GPU_ENV, "ODC_CHUNK_BYTES": "1M", "ODC_RING_SLOTS": "2", "ODC_AG_PUSH": "1"}
    res = run_distributed(_mixed_outputs_worker, world, backend="cpu:gloo,cuda:odc", env=env,
                          timeout_s=60, deadline_s=240)
    for rank, (errors, calls) in res.items():
        assert not errors, f"rank {rank}: " + "\n".join(errors)
        # Every call after the first pushed into exactly the reused outputs: half the ranks were
        # pushed into while the other half read for themselves, in the same call.
        assert [got for got, _ in calls] == [want for _, want in calls], (rank, calls)
