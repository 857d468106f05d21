"""The collectives benchmark's per-size measurements: the bitwise check of odc against the
reference, the floor (the least bytes each rank must move, on local buffers) and the
latency / bandwidth of each backend, interleaved."""
from __future__ import annotations

import functools
import traceback

from collectives_setup import (BenchContext, all_gather, all_true, buffer, host_barrier, ops_per_trial,
                               output_buffer, reduce_floats, reduce_scatter, time_loop)
from collectives_util import engine_from_stats, guesses_from_stats, median, percentile, size_label


# --------------------------------------------------------------------------- correctness
def _generator(ctx: BenchContext, seed: int):
    g = ctx.torch.Generator(device=ctx.device)
    g.manual_seed(seed)
    return g


def _compare(ctx: BenchContext, res: dict, prefix: str, got: dict, expected):
    """res[<prefix>_equal_expected_<b>] and res[<prefix>_equal_<b>_vs_<ref>], on every rank."""
    torch, ref = ctx.torch, ctx.ref
    for b, t in got.items():
        res[f"{prefix}_equal_expected_{b}"] = all_true(ctx, torch.equal(t, expected))
    for b in ctx.others():
        if b in got and ref in got:
            res[f"{prefix}_equal_{b}_vs_{ref}"] = all_true(ctx, torch.equal(got[b], got[ref]))


def _check_all_gather(ctx: BenchContext, res: dict, numel: int, shard: int):
    """Random bf16 bits, in-place: the input is this rank's slot of the output."""
    torch, n, r = ctx.torch, ctx.world, ctx.rank
    expected = torch.cat([torch.randn(shard, generator=_generator(ctx, 1000 + q), device=ctx.device,
                                      dtype=torch.float32).to(ctx.dtype) for q in range(n)])
    out = torch.empty(numel, dtype=ctx.dtype, device=ctx.device)
    got = {}
    for b in ctx.order:
        out.fill_(float("nan"))  # poison: stale data from another backend cannot pass
        out[r * shard:(r + 1) * shard].copy_(expected[r * shard:(r + 1) * shard])
        try:
            o = buffer(ctx, b, out)
            all_gather(ctx, b, o, o[r * shard:(r + 1) * shard])
            got[b] = o.clone()
            del o
        except Exception:  # noqa: BLE001
            res[f"ag_error_{b}"] = traceback.format_exc(limit=3)
    del out  # free before the comparisons, as the largest sizes need
    _compare(ctx, res, "ag", got, expected)


def _check_reduce_scatter(ctx: BenchContext, res: dict, numel: int, shard: int):
    """Small integers: exact in bf16 whatever the summation order; SUM, and AVG where exact."""
    torch, dist, n, r = ctx.torch, ctx.dist, ctx.world, ctx.rank
    inputs = [torch.randint(-8, 9, (numel,), generator=_generator(ctx, 2000 + q), device=ctx.device,
                            dtype=torch.int8) for q in range(n)]
    exp_sum = sum(x[r * shard:(r + 1) * shard].float() for x in inputs)
    mine = inputs[r].to(ctx.dtype)
    del inputs
    ops = [("sum", dist.ReduceOp.SUM, exp_sum.to(ctx.dtype))]
    if n & (n - 1) == 0:  # division by a power of two is exact too
        ops.append(("avg", dist.ReduceOp.AVG, (exp_sum / n).to(ctx.dtype)))
    for name, op, exp in ops:
        got = {}
        for b in ctx.order:
            o = torch.full((shard,), float("nan"), dtype=ctx.dtype, device=ctx.device)
            try:
                o = output_buffer(ctx, b, o)
                reduce_scatter(ctx, b, o, buffer(ctx, b, mine), op)
                got[b] = o.clone() if b in ctx.windows else o  # the window's slot is reused
            except Exception:  # noqa: BLE001
                res[f"rs_{name}_error_{b}"] = traceback.format_exc(limit=3)
        _compare(ctx, res, f"rs_{name}", got, exp)


def check(ctx: BenchContext, nbytes: int) -> dict:
    """Bitwise checks of odc against the reference backend and the expected tensors."""
    numel = nbytes // 2
    shard = numel // ctx.world
    res: dict = {"op": "check", "size_bytes": nbytes, "size": size_label(nbytes)}
    _check_all_gather(ctx, res, numel, shard)
    _check_reduce_scatter(ctx, res, numel, shard)
    if ctx.cuda:
        ctx.torch.cuda.synchronize()
    return res


# --------------------------------------------------------------------------- floor
def floor_fns(ctx: BenchContext, op: str, nbytes: int, inp) -> dict:
    """The floor of ``op`` at ``nbytes``: each rank moves the least bytes the collective needs
    for it, on local buffers (no CUDA IPC; in the lab all ranks share one GPU's memory, so a
    local copy of the same bytes is the same memory traffic). name -> (fn, engine):

    * all_gather: copy (W-1)/W * S bytes (what the gather brings each rank), with the copy
      engine (``copy_``: cudaMemcpyAsync device to device, as odc's copies) and with an SM
      kernel (``torch.mul(src, 1, out=dst)``: an elementwise kernel, same bytes);
    * reduce_scatter: read the W chunks of S/W bytes of one shard and write their sum, with
      an SM kernel (``torch.sum`` over a (W, S/W) view of the input, fp32 accumulation);
      and copy engine + sum: the W-1 other chunks staged by cudaMemcpyAsync, then the same
      sum (a copy engine cannot add, so this one moves more bytes).
    """
    torch, n = ctx.torch, ctx.world
    if n < 2:
        return {}
    shard = nbytes // 2 // n
    kw = dict(dtype=ctx.dtype, device=ctx.device)
    # same-device cudaMemcpyAsync: the call odc's copy path makes (in the lab its peer
    # pointers are on the same device too), whichever unit the driver runs it on
    ce = "cudaMemcpyAsync D2D (copy_)" if ctx.cuda else "memcpy (copy_)"
    if op == "all_gather":
        src = torch.ones((n - 1) * shard, **kw)
        dst = torch.empty((n - 1) * shard, **kw)
        return {"floor_ce": (lambda: dst.copy_(src), ce),
                "floor_sm": (lambda: torch.mul(src, 1, out=dst),
                             "SM kernel (elementwise mul by 1)" if ctx.cuda else "elementwise mul by 1")}
    chunks = inp.view(n, shard)  # the input's W chunks: the bytes of one shard's sum
    red = torch.empty(shard, **kw)
    stage = torch.empty(n, shard, **kw)
    stage[n - 1].copy_(chunks[ctx.rank])  # this rank's own chunk needs no transfer
    others = inp[: (n - 1) * shard]  # as many bytes as the W-1 peers' chunks
    flat = stage.view(-1)[: (n - 1) * shard]

    def staged():
        flat.copy_(others)
        torch.sum(stage, dim=0, out=red)
    return {"floor_sm": (lambda: torch.sum(chunks, dim=0, out=red),
                         "SM kernel (torch.sum over the W chunks)" if ctx.cuda else "torch.sum over the W chunks"),
            "floor_ce": (staged, ce + " of the W-1 chunks, then torch.sum")}


def _floor_row(rows: list[dict], floors: dict, op: str, n: int, shard: int) -> dict | None:
    """The floor: the faster of the two engines (by median)."""
    cands = [row for row in rows if row["backend"] in floors]
    if not cands:
        return None
    best = min(cands, key=lambda row: row["latency_us"])
    moved = ({"read": (n - 1) * shard * 2, "write": (n - 1) * shard * 2} if op == "all_gather"
             else {"read": n * shard * 2, "write": shard * 2})
    return {**best, "backend": "floor", "floor_engine": best["backend"], "floor_bytes_moved_per_rank": moved}


# --------------------------------------------------------------------------- latency / bandwidth
def _collective_calls(ctx: BenchContext, op: str, nbytes: int):
    """(the input, backend -> the call to time): only the call is timed, so the input views and
    the arguments are made here, once."""
    torch, r = ctx.torch, ctx.rank
    numel = nbytes // 2
    shard = numel // ctx.world
    if op == "all_gather":
        out = torch.randn(numel, device=ctx.device, dtype=torch.float32).to(ctx.dtype)
        inp = out[r * shard:(r + 1) * shard]
        outs = {b: buffer(ctx, b, out) for b in ctx.order}
        return inp, {b: functools.partial(ctx.gather, outs[b], outs[b][r * shard:(r + 1) * shard],
                                          group=ctx.groups[b]) for b in ctx.order}
    inp = torch.randn(numel, device=ctx.device, dtype=torch.float32).to(ctx.dtype)
    out = torch.empty(shard, device=ctx.device, dtype=ctx.dtype)
    inps = {b: buffer(ctx, b, inp) for b in ctx.order}
    outs = {b: output_buffer(ctx, b, out) for b in ctx.order}
    return inp, {b: functools.partial(ctx.scatter, outs[b], inps[b], op=ctx.dist.ReduceOp.SUM,
                                      group=ctx.groups[b]) for b in ctx.order}


def _time_interleaved(ctx: BenchContext, fns: dict, backends: list[str], k: int):
    """Per backend, the per-trial latencies and host times of ``k`` calls (this rank's). The
    backends take turns, their order alternated per trial, so drift hits all alike."""
    for b in backends:  # warm-up (connections, buffer registration, clocks)
        for _ in range(ctx.args.warmup):
            host_barrier(ctx)
            time_loop(ctx, fns[b], k)
    times = {b: [] for b in backends}
    host = {b: [] for b in backends}
    for i in range(ctx.args.trials):
        for b in (backends if i % 2 == 0 else backends[::-1]):
            host_barrier(ctx)
            latency_us, host_us = time_loop(ctx, fns[b], k)
            times[b].append(latency_us)
            host[b].append(host_us)
    return times, host


BACKENDS_OF_ODC = ("odc", "odc_nocheck", "odc_staged", "odc_staged_push", "odc_registered")


def _stats(ctx: BenchContext, backend: str) -> dict:
    from torch_odc_backend import backend_stats
    return backend_stats(ctx.groups[backend], device="cuda")


def engine_of(ctx: BenchContext, backend: str, fn) -> dict:
    """The engine and SMs of one call of ``fn`` on ``backend``'s group (its stats)."""
    before = _stats(ctx, backend)
    fn()
    return engine_from_stats(before, _stats(ctx, backend))


def _latency_row(ctx: BenchContext, op: str, b: str, nbytes: int, k: int, times: list, host: list) -> dict:
    n = ctx.world
    per_trial = reduce_floats(ctx, times, "max")  # the slowest rank ends the collective
    host_us = median(reduce_floats(ctx, host, "max"))
    lat = median(per_trial)
    algbw = nbytes / (lat * 1e-6) / 1e9
    return {
        "op": op, "backend": b, "size_bytes": nbytes, "size": size_label(nbytes),
        "dtype": "bf16", "world_size": n, "ops_per_trial": k, "trials": len(per_trial),
        "latency_us": lat, "latency_us_min": min(per_trial), "latency_us_p90": percentile(per_trial, 0.9),
        "algbw_GBps": algbw, "busbw_GBps": algbw * (n - 1) / n, "host_us": host_us,
    }


def measure(ctx: BenchContext, op: str, nbytes: int, skip: set) -> list[dict]:
    """Latency and bandwidth of ``op`` at ``nbytes`` on every backend not in ``skip`` (and the
    floor where on): one row per backend, and a "floor" row."""
    inp, fns = _collective_calls(ctx, op, nbytes)
    backends = [b for b in ctx.order if b not in skip]
    floors = floor_fns(ctx, op, nbytes, inp) if ctx.floor else {}
    for name, (fn, _) in floors.items():  # timed like a backend, interleaved with them
        fns[name] = fn
        backends.append(name)
    k = ops_per_trial(ctx.args, nbytes)
    odc = [b for b in backends if ctx.cuda and b in BACKENDS_OF_ODC]
    stats_before = {b: _stats(ctx, b) for b in odc}
    times, host = _time_interleaved(ctx, fns, backends, k)
    guesses = {b: guesses_from_stats(stats_before[b], _stats(ctx, b)) for b in odc}  # the timed calls'
    engines = {b: engine_of(ctx, b, fns[b]) for b in odc}  # for one more call (every rank calls)
    rows = []
    for b in backends:
        row = _latency_row(ctx, op, b, nbytes, k, times[b], host[b])
        if b in floors:
            row["engine"] = floors[b][1]
        elif ctx.cuda and b in engines:
            row.update({f"odc_{key}": v for key, v in {**engines[b], **guesses[b]}.items()})
        elif b in ctx.nccl_rows:  # its buffers and CTA policy (NCCL reports no SM count)
            row.update(ctx.nccl_rows[b])
        rows.append(row)
    floor = _floor_row(rows, floors, op, ctx.world, nbytes // 2 // ctx.world)
    if floor:
        rows.append(floor)
    return rows
