#!/usr/bin/env python3
"""Simulated minibatch times of the balancing schemes, from a measured microbatch-time fit.

    python benchmarks/balance_sim.py                       # writes <out-dir>/balance_sim_model_<date>.json
    python benchmarks/balance_sim.py --fit RESULT.json     # the fit of another train_imbalanced run

No GPU and no training: each microbatch costs ``a + b * tokens + c * sum(length^2)`` seconds
(the calibration of ``benchmarks/train_imbalanced.py`` on GPUs, read from its result JSON),
optionally times a per-microbatch error the planner does not see (``--error SIGMA``: a
lognormal factor, the cost model's error), times the rank's slowdown. Minibatches are the
benchmark's long-tailed documents (same generator and seeds). Schemes, per minibatch:

* ``sync_lbmicro``: per-layer synchronous FSDP with LB-Micro: sum over steps of the slowest
  rank (a padding microbatch costs the 8-token dummy the benchmark runs);
* ``static_lbmini``: decoupled mode, LB-Mini: the slowest rank's total;
* ``dynamic_single_queue``: one queue of the minibatch packed with ``balance.pack`` (fewest
  microbatches, most expensive first), each taken by the first free rank;
* ``dynamic_guided``: one queue of decreasing sizes (each microbatch about the remaining
  work / (2 x ranks), at least an eighth of the token cap), first free rank takes;
* ``dynamic_balancer``: what ``balance.DynamicBalancer`` does: LB-Mini weighted by the ranks'
  speeds (known here, as after the balancer has measured them), own queue first, then single
  items from the back of the fullest other queue; the last microbatch of each queue split
  into its documents, which its owner trains together if nobody took them.

Reported: each scheme's speedup over ``sync_lbmicro`` (total time ratio over all minibatches)
and the packed perfect-balance bound (``balance.balance_bound`` of ``pack``'s microbatches).
It guided the choice of ``DynamicBalancer``'s design; it is a model, not a measurement.
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from pathlib import Path

import torch

import _meta
from torch_odc_backend import balance
from train_imbalanced import make_documents

REPO = Path(__file__).resolve().parents[1]
DEFAULT_FIT = REPO / "benchmarks" / "results" / "train_imbalanced_nvidia-h200-x2-docs8_20261122_9b8d173.json"


def list_schedule(costs, slow):
    """Items in order, each to the rank that frees first; the makespan."""
    free = [(0.0, r) for r in range(len(slow))]
    heapq.heapify(free)
    for c in costs:
        t, r = heapq.heappop(free)
        heapq.heappush(free, (t + c * slow[r], r))
    return max(t for t, _ in free)


def guided(d, world, fit, max_tokens):
    left = sorted(range(len(d)), key=lambda i: -d[i])
    fixed, floor, out = fit([]), fit([max_tokens // 8]), []
    while left:
        target = max(sum(fit([d[i]]) - fixed for i in left) / (2 * world) + fixed, floor)
        mb, k = [left.pop(0)], 0
        while k < len(left):
            i = left[k]
            if sum(d[j] for j in mb) + d[i] <= max_tokens and fit([d[j] for j in mb] + [d[i]]) <= target:
                mb.append(left.pop(k))
            else:
                k += 1
        out.append(mb)
    return sorted(out, key=lambda mb: -fit([d[i] for i in mb]))


def balancer(plan, true_cost, slow):
    """DynamicBalancer's taking rule as an event simulation."""
    world = len(plan)
    queues = []
    for rank_plan in plan:
        items = []
        for g, mb in enumerate(rank_plan):
            split = g == len(rank_plan) - 1 and len(mb) > 1
            items += [(g, [i]) for i in mb] if split else [(g, list(mb))]
        queues.append(items)
    free = [(0.0, r) for r in range(world)]
    heapq.heapify(free)
    end = 0.0
    while free:
        t, r = heapq.heappop(free)
        if queues[r]:
            g, docs = queues[r][0][0], []
            while queues[r] and queues[r][0][0] == g:
                docs += queues[r].pop(0)[1]
        else:
            others = [v for v in range(world) if queues[v]]
            if not others:
                end = max(end, t)
                continue
            victim = max(others, key=lambda v: (len(queues[v]), -v))
            docs = queues[victim].pop()[1]
        heapq.heappush(free, (t + true_cost(docs) * slow[r], r))
    return end


def simulate(world, docs_per_rank, slowdown, error, fit, max_tokens, minibatches, seed):
    slow = [1.0] * (world - 1) + [slowdown]
    totals = {}
    for s in range(minibatches):
        d = make_documents(docs_per_rank * world, 1000 + s, False, 16500, max_tokens)
        rng = random.Random(seed * 7919 + s)
        noise = {}

        def true_cost(mb):  # the planner sees fit(); the run costs fit() x a fixed error per microbatch
            key = tuple(sorted(mb))
            if key not in noise:
                noise[key] = math.exp(rng.gauss(0.0, error)) if error > 0 else 1.0
            return fit([d[i] for i in mb]) * noise[key]

        micro = balance.lb_micro(d, world, max_tokens, fit)
        steps = max(len(p) for p in micro)
        mini = balance.lb_mini(d, world, max_tokens, fit)
        packed = balance.pack(d, max_tokens, fit)
        times = {
            "sync_lbmicro": sum(max((true_cost(micro[r][j]) if micro[r][j] else fit([8])) * slow[r]
                                    for r in range(world)) for j in range(steps)),
            "static_lbmini": max(sum(true_cost(mb) for mb in mini[r]) * slow[r] for r in range(world)),
            "dynamic_single_queue": list_schedule([true_cost(mb) for mb in packed], slow),
            "dynamic_guided": list_schedule([true_cost(mb) for mb in guided(d, world, fit, max_tokens)], slow),
            "dynamic_balancer": balancer(balance.lb_mini_weighted(d, slow, max_tokens, fit), true_cost, slow),
            "bound_packed": balance.balance_bound([true_cost(mb) for mb in packed], slow),
        }
        for k, v in times.items():
            totals[k] = totals.get(k, 0.0) + v
    return {k: totals["sync_lbmicro"] / v for k, v in totals.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fit", type=Path, default=DEFAULT_FIT, help="train_imbalanced result JSON with a calibration fit")
    p.add_argument("--minibatches", type=int, default=150)
    p.add_argument("--out-dir", default=str(_meta.default_out_dir()), help=_meta.OUT_DIR_HELP)
    args = p.parse_args()
    meta = json.loads(args.fit.read_text())
    f = meta["summary"]["microbatch_time_fit"]
    fit = balance.FittedCost(f["a_s"], f["b_s_per_token"], f["c_s_per_token_pair"])
    max_tokens = meta["args"]["max_tokens"]
    rows = []
    for world in (2, 4, 8):
        for docs_per_rank in (4, 8):
            for slowdown in (1.0, 1.3):
                for error in (0.0, 0.15):
                    ratios = simulate(world, docs_per_rank, slowdown, error, fit, max_tokens,
                                      args.minibatches, seed=world * 100 + docs_per_rank)
                    rows.append({"world": world, "docs_per_rank": docs_per_rank, "slowdown": slowdown,
                                 "cost_model_error_sigma": error, "speedup_vs_sync_lbmicro": ratios})
                    print(f"W={world} docs/rank={docs_per_rank} slow={slowdown} error={error}: "
                          + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()), flush=True)
    out = _meta.result_path(args.out_dir, "balance_sim", "model", "")
    out.write_text(json.dumps({"benchmark": "balance_sim", "fit_from": str(args.fit.relative_to(REPO)),
                               "fit": f, "max_tokens": max_tokens, "minibatches": args.minibatches,
                               **_meta.stamp(torch.device("cpu")), "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
