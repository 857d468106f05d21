"""GPU cases of what a group's ranks must never get wrong whatever their layout:

- more ranks than GPUs, unevenly (3 ranks on 2 GPUs: ranks 0 and 2 share one, rank 1 has the
  other alone) or evenly (4 on 2): a randomized mix of all-gathers, reduce-scatters,
  all-reduces and broadcasts with ranks out of step completes and equals a float64 reference
  (odc serves the all-reduces and broadcasts itself there: every rank decides so alike);
- a collective captured into a CUDA graph is refused with a clear error, before anything is
  issued, and the group goes on working;
- a segment the owner frees (``empty_cache``) while a peer's GPU lags seconds behind its host,
  with that peer's read of it still queued: the read finds the segment mapped and the results
  are right.
"""
from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import GPU_ENV, gpu_test, run_distributed

BACKEND = "cpu:gloo,cuda:odc"
R = dist.ReduceOp


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def _input(seed: int, rank: int, n: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return (torch.randint(-64, 65, (n,), generator=g).to(torch.float64) / 8).to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor, dtype) -> bool:
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    return torch.allclose(got.double().cpu(), want, rtol=tol, atol=tol)


def _mix_worker(rank, world, calls, engine_env=None):
    """`engine_env`: knobs rank 1 alone sets for the group the calls run on (only how it runs its
    own steps: the ranks still agree on everything their peers read)."""
    import os

    dev = _device()
    if engine_env and rank == 1:
        os.environ.update(engine_env)
    group = dist.new_group(list(range(world)))  # its options are read now
    for k in engine_env or {}:
        os.environ.pop(k, None)
    plan = random.Random(1234)  # the same sequence of collectives on every rank
    skew = random.Random(rank)  # each rank out of step in its own way
    errors = []
    for i in range(calls):
        kind = plan.choice(["ag", "rs", "ar", "bcast"])
        dtype = plan.choice([torch.float32, torch.bfloat16])
        n = plan.choice([1, 5, 1000, 40_000, 1_000_000, 3_000_000])
        op = plan.choice([R.SUM, R.AVG]) if kind == "rs" else plan.choice([R.SUM, R.MAX])
        root = plan.randrange(world)
        ins = [_input(i, r, n, dtype) for r in range(world)]
        if skew.random() < 0.3:
            time.sleep(skew.random() * 0.02)  # this rank's host late
        if skew.random() < 0.3:
            torch.cuda._sleep(int(skew.random() * 2e7))  # this rank's GPU late
        if kind == "ag":
            out = torch.full((world * n,), float("nan"), dtype=dtype, device=dev)
            dist.all_gather_into_tensor(out, ins[rank].to(dev), group=group)
            ok = torch.equal(out.cpu(), torch.cat(ins))
        elif kind == "rs":
            out = torch.full((n,), float("nan"), dtype=dtype, device=dev)
            full = [_input(i, r, world * n, dtype) for r in range(world)]
            dist.reduce_scatter_tensor(out, full[rank].to(dev), op=op, group=group)
            want = torch.stack([f.double() for f in full]).sum(0)[rank * n:(rank + 1) * n]
            ok = _close(out, want / world if op == R.AVG else want, dtype)
        elif kind == "ar":
            t = ins[rank].to(dev)
            dist.all_reduce(t, op=op, group=group)
            stacked = torch.stack([x.double() for x in ins])
            ok = _close(t, stacked.sum(0) if op == R.SUM else stacked.max(0).values, dtype)
        else:
            t = ins[rank].to(dev) if rank == root else torch.full((n,), float("nan"), dtype=dtype, device=dev)
            dist.broadcast(t, src=root, group=group)
            ok = torch.equal(t.cpu(), ins[root])
        if not ok:
            errors.append(f"call {i}: {kind} of {n} {dtype} (op {op}, root {root}) differs from the reference")
    torch.cuda.synchronize()
    from torch_odc_backend import backend_stats

    return errors, backend_stats(group, device=str(dev))


@gpu_test(2)
@pytest.mark.parametrize("world", [3, 4], ids=["3-ranks-on-2-gpus", "4-ranks-on-2-gpus"])
def test_mixed_collectives_with_more_ranks_than_gpus(world):
    if torch.cuda.device_count() >= world:
        pytest.skip(f"{torch.cuda.device_count()} GPUs: the ranks would not share them")
    res = run_distributed(_mix_worker, world, 60, backend=BACKEND, env=dict(GPU_ENV),
                          timeout_s=60, deadline_s=300)
    for rank, (errors, stats) in res.items():
        assert not errors, f"rank {rank}: " + "\n".join(errors)
        # every rank served the all-reduces and broadcasts itself (NCCL refuses the layout)
        assert stats.get("own_all_reduce_ops", 0) > 0 and stats.get("own_broadcast_ops", 0) > 0, (rank, stats)


@gpu_test(2)
def test_ranks_on_different_engines_work_together():
    """Rank 1 runs every collective on the copy engines (ODC_SMALL_OP_BYTES=0), rank 0 its small
    ones on the fused kernel: an engine is a rank's own choice, the protocol is the same."""
    res = run_distributed(_mix_worker, 2, 40, {"ODC_SMALL_OP_BYTES": "0"}, backend=BACKEND,
                          env=dict(GPU_ENV), timeout_s=60, deadline_s=300)
    for rank, (errors, stats) in res.items():
        assert not errors, f"rank {rank}: " + "\n".join(errors)
        assert (stats.get("fused_ops", 0) > 0) == (rank == 0), (rank, stats)


def _captured(call):
    """None if `call` was captured into a CUDA graph, else (exception type, message)."""
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            call()
        return None
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)


def _capture_worker(rank, world):
    dev = _device()
    inp = torch.full((1000,), float(rank), device=dev)
    out = torch.empty(world * 1000, device=dev)
    fresh = dist.new_group(list(range(world)))  # its first collective under capture: no set-up there
    other = dist.new_group(list(range(world)))
    small = torch.ones(4, device=dev)
    refused = [_captured(lambda: dist.all_gather_into_tensor(out, inp, group=fresh)),
               _captured(lambda: dist.all_reduce(small, group=other))]  # odc's own (NCCL cannot)
    dist.all_gather_into_tensor(out, inp)  # the default group set up outside capture
    torch.cuda.synchronize()
    for async_op in (False, True):
        refused.append(_captured(lambda: dist.all_gather_into_tensor(out, inp, async_op=async_op)))
    refused.append(_captured(lambda: dist.all_reduce(small)))
    inp.fill_(10.0 + rank)
    dist.all_gather_into_tensor(out, inp)  # nothing was issued: the group goes on
    return refused, out.cpu().tolist()


@gpu_test(1)
def test_capture_into_a_cuda_graph_is_refused():
    world = 2
    res = run_distributed(_capture_worker, world, backend=BACKEND, env=dict(GPU_ENV),
                          timeout_s=30, deadline_s=180)
    want = [10.0 + r for r in range(world) for _ in range(1000)]
    for rank, (refused, after) in res.items():
        for got in refused:
            assert got is not None, f"rank {rank}: an odc collective was captured into a CUDA graph"
            assert got[0] == "NotImplementedError" and "cannot be captured into a CUDA graph" in got[1], (rank, got)
        assert after == want, f"rank {rank}: the group did not go on working after the refusal"


# ~1 s of GPU time (torch.cuda._sleep counts cycles; H100 / H200 run near 2 GHz)
LAG_CYCLES = 2_000_000_000
N = 16 << 20  # fp32 elements: a 64 MiB input, a segment of its own


def _lagging_reader_worker(rank, world):
    from torch_odc_backend import backend_stats

    dev = _device()
    errors, in_place = [], []
    for it in range(3):
        x = torch.full((N,), float(10 * it + rank), device=dev)
        out = torch.empty(world * N, device=dev)
        for _ in range(2):  # staged once; then every peer has mapped x's segment
            dist.all_gather_into_tensor(out, x)
            dist.barrier()
        before = backend_stats(device=str(dev)).get("direct_in_place_ops", 0)
        if rank == 1:
            torch.cuda._sleep(LAG_CYCLES)  # the reader's GPU falls seconds behind its host
        dist.all_gather_into_tensor(out, x)  # read in place; rank 1 reads rank 0's x late
        in_place.append(backend_stats(device=str(dev)).get("direct_in_place_ops", 0) - before)
        if rank == 0:
            del x
            torch.cuda.empty_cache()  # x's segment goes back to the driver (the allocator's hook)
        else:
            time.sleep(0.3)  # (rank 0 is in empty_cache by now)
        # the next collective: the reader takes in what its peers shared and ended
        y = torch.full((8,), float(rank), device=dev)
        dist.all_gather_into_tensor(torch.empty(world * 8, device=dev), y)
        torch.cuda.synchronize()
        want = torch.cat([torch.full((N,), float(10 * it + r)) for r in range(world)])
        if not torch.equal(out.cpu(), want):
            errors.append(f"iteration {it}: the all-gather read while the segment ended differs")
        del out
        dist.barrier()
    return errors, in_place


@gpu_test(2)
def test_freed_segment_while_a_reader_lags():
    world = 2
    res = run_distributed(_lagging_reader_worker, world, backend=BACKEND, env=dict(GPU_ENV),
                          timeout_s=60, deadline_s=240)
    for rank, (errors, in_place) in res.items():
        assert not errors, f"rank {rank}: " + "\n".join(errors)
        assert all(k >= 1 for k in in_place), (rank, in_place)  # the scenario happened: in place
