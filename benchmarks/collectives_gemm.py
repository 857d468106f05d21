"""The collectives benchmark's GEMM interference (CUDA only): a bf16 GEMM loop on the default
stream timed alone and while an all-gather runs continuously on another stream, per backend;
slowdown = t_concurrent / t_alone - 1."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from collectives_setup import BenchContext, all_gather, all_true, host_barrier, reduce_floats, time_loop
from collectives_util import median, size_label


@dataclass
class GemmWork:
    """The GEMM's operands, the all-gather's buffers and the two streams they run on."""
    x: Any
    y: Any
    z: Any
    out: Any  # the all-gather's output; inp is this rank's slot of it (in-place)
    inp: Any
    side: Any  # the all-gathers' stream
    cur: Any  # the GEMMs' stream (the current one)
    iters: int  # GEMMs per timed loop


def _make_work(ctx: BenchContext, ag_bytes: int) -> GemmWork:
    torch, n, r, N = ctx.torch, ctx.world, ctx.rank, ctx.args.gemm_n
    x = torch.randn(N, N, device=ctx.device, dtype=ctx.dtype)
    y = torch.randn(N, N, device=ctx.device, dtype=ctx.dtype)
    z = torch.empty(N, N, device=ctx.device, dtype=ctx.dtype)
    numel = ag_bytes // 2
    shard = numel // n
    out = torch.randn(numel, device=ctx.device, dtype=torch.float32).to(ctx.dtype)
    return GemmWork(x, y, z, out, out[r * shard:(r + 1) * shard], torch.cuda.Stream(device=ctx.device),
                    torch.cuda.current_stream(ctx.device), ctx.args.gemm_iters)


def _gemm_alone(ctx: BenchContext, w: GemmWork) -> float:
    """Milliseconds of the GEMM loop by itself."""
    torch = ctx.torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(w.cur)
    for _ in range(w.iters):
        torch.mm(w.x, w.y, out=w.z)
    end.record(w.cur)
    end.synchronize()
    return start.elapsed_time(end)


def _gemm_concurrent(ctx: BenchContext, w: GemmWork, b: str, n_ag: int) -> tuple[float, float]:
    """(GEMM loop ms, all-gathers' span ms) with ``n_ag`` all-gathers on ``b`` issued on the side
    stream, spread evenly between the GEMMs."""
    torch = ctx.torch
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    ev[0].record(w.cur)
    w.side.wait_stream(w.cur)  # both streams start together
    per = n_ag / w.iters
    issued = 0
    for i in range(w.iters):
        torch.mm(w.x, w.y, out=w.z)
        want = min(n_ag, math.ceil((i + 1) * per))
        with torch.cuda.stream(w.side):
            while issued < want:
                all_gather(ctx, b, w.out, w.inp)
                issued += 1
    ev[1].record(w.cur)
    with torch.cuda.stream(w.side):
        while issued < n_ag:
            all_gather(ctx, b, w.out, w.inp)
            issued += 1
        ev[2].record(w.side)
    w.cur.wait_stream(w.side)
    torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]), ev[0].elapsed_time(ev[2])


def _calibrate(ctx: BenchContext, w: GemmWork) -> dict:
    """Warm-up; per backend the all-gathers per concurrent trial (enough to outlast the GEMM
    loop even when slowed down by it)."""
    a = ctx.args
    for _ in range(2):
        host_barrier(ctx)
        _gemm_alone(ctx, w)
    t_alone_est = reduce_floats(ctx, [median([_gemm_alone(ctx, w) for _ in range(3)])], "max")[0]
    n_ag = {}
    for b in ctx.order:
        def gather_once(b=b):
            all_gather(ctx, b, w.out, w.inp)
        host_barrier(ctx)
        time_loop(ctx, gather_once, 3)
        host_barrier(ctx)
        t_ag_ms = reduce_floats(ctx, [time_loop(ctx, gather_once, 5)[0] / 1e3], "max")[0]
        n_ag[b] = max(2, min(a.gemm_max_ag, math.ceil(a.gemm_ag_cover * t_alone_est / t_ag_ms) + 1))
        host_barrier(ctx)
        _gemm_concurrent(ctx, w, b, n_ag[b])  # warm-up of the concurrent pattern
    return n_ag


def _gemm_trials(ctx: BenchContext, w: GemmWork, n_ag: dict):
    """This rank's GEMM loop ms per config ("alone" and each backend) and all-gather spans per
    backend; the configs' order rotated per trial."""
    configs = ["alone"] + list(ctx.order)
    gemm_ms = {c: [] for c in configs}
    span_ms = {b: [] for b in ctx.order}
    for t in range(ctx.args.gemm_trials):
        rot = t % len(configs)
        for c in configs[rot:] + configs[:rot]:
            host_barrier(ctx)
            if c == "alone":
                g = _gemm_alone(ctx, w)
            else:
                g, s = _gemm_concurrent(ctx, w, c, n_ag[c])
                span_ms[c].append(s)
            gemm_ms[c].append(g)
    return gemm_ms, span_ms


def _gemm_rows(ctx: BenchContext, ag_bytes: int, n_ag: dict, gemm_ms: dict, span_ms: dict) -> list[dict]:
    a, n, N, G = ctx.args, ctx.world, ctx.args.gemm_n, ctx.args.gemm_iters
    # a local effect: mean over ranks
    med = {c: median(reduce_floats(ctx, gemm_ms[c], "mean")) for c in gemm_ms}
    common = {"ag_size_bytes": ag_bytes, "ag_size": size_label(ag_bytes), "gemm_n": N, "gemm_iters": G}
    tflops = 2 * N ** 3 * G / (med["alone"] * 1e-3) / 1e12
    rows = [{"op": "gemm", "backend": "alone", **common, "gemm_ms": med["alone"],
             "gemm_ms_per_iter": med["alone"] / G, "gemm_tflops": tflops, "slowdown": 0.0,
             "trials": a.gemm_trials}]
    for b in ctx.order:
        spans = reduce_floats(ctx, span_ms[b], "max")
        covered = all_true(ctx, all(s >= g for s, g in zip(span_ms[b], gemm_ms[b])))
        ag_ms = median(spans) / n_ag[b]
        rows.append({
            "op": "gemm", "backend": b, **common, "gemm_ms": med[b], "gemm_ms_per_iter": med[b] / G,
            "slowdown": med[b] / med["alone"] - 1.0, "trials": a.gemm_trials,
            "ag_per_trial": n_ag[b], "ag_covered_gemm": covered, "ag_ms_concurrent": ag_ms,
            "ag_busbw_concurrent_GBps": ag_bytes / (ag_ms * 1e-3) / 1e9 * (n - 1) / n,
        })
    return rows


def gemm_interference(ctx: BenchContext, ag_bytes: int) -> list[dict]:
    """One row for the GEMM loop alone and one per backend with its all-gather of ``ag_bytes``."""
    w = _make_work(ctx, ag_bytes)
    n_ag = _calibrate(ctx, w)
    gemm_ms, span_ms = _gemm_trials(ctx, w, n_ag)
    return _gemm_rows(ctx, ag_bytes, n_ag, gemm_ms, span_ms)
