#!/usr/bin/env python3
"""Imbalanced variable-length training: exact mode + LB-Micro vs decoupled mode + LB-Mini.

    torchrun --standalone --nproc-per-node=2 benchmarks/train_imbalanced.py        # CPU, ~1 min

Each minibatch holds synthetic documents with long-tailed lengths (lognormal, seeded; or
constant lengths with ``--balanced``), packed into token-capped microbatches with
per-document causal attention. Configurations run side by side in one job, on the same
documents, from the same initial weights:

* ``exact_lbmicro``: FSDP2 on odc exact mode; ``balance.lb_micro`` gives every rank the
  same number of microbatches (an empty one becomes a zero-weight dummy so that every
  rank joins every layer's collectives);
* ``decoupled_lbmini``: ``odc.decouple``; ``balance.lb_mini`` balances each rank's total
  cost, counts may differ; one ``odc.sync`` per minibatch.

Reported per configuration (rank 0 writes ``benchmarks/results/train_imbalanced_<kind>_<date>.json``):
tokens/s, mean step time, the decoupled bubble rate (``odc.metrics``), the plans' predicted
ideal speedup (``plan_stats``: sum over steps of the slowest rank vs the slowest rank's
total, from the cost model) and the measured speedup. The GPU version of this benchmark
(a 1.5B-parameter model on 4 GPUs) needs decoupled mode validated on GPUs first.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torch_odc_backend as odc
from torch_odc_backend import balance

REPO = Path(__file__).resolve().parents[1]


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x, mask):
        t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(t, 3, self.heads, d // self.heads).permute(1, 2, 0, 3)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(a.transpose(0, 1).reshape(t, d))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class PackedLM(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, tokens, doc_ids):
        # per-document causal attention inside one packed sequence
        same = doc_ids[:, None] == doc_ids[None, :]
        mask = same & torch.ones_like(same).tril()
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x, mask)
        return self.head(self.norm(x))


def make_documents(n: int, seed: int, balanced: bool, mean: int, cap: int) -> list[int]:
    rng = random.Random(seed)
    if balanced:
        return [mean] * n
    sigma = 1.0
    mu = math.log(mean) - sigma * sigma / 2  # lognormal with the requested mean
    return [max(8, min(cap, int(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def microbatch(doc_lengths: list[int], vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    toks, ids = [], []
    for i, n in enumerate(doc_lengths):
        toks.append(torch.randint(0, vocab, (n + 1,), generator=g))
        ids.append(torch.full((n + 1,), i))
    t, d = torch.cat(toks), torch.cat(ids)
    return t[:-1], t[1:], d[:-1]


def train_steps(model, opt, plans, docs, args, decoupled: bool) -> list[float]:
    """One optimizer step per minibatch; returns the step times (wall, rank-local)."""
    rank = dist.get_rank()
    times = []
    for step, (plan, lengths) in enumerate(zip(plans, docs)):
        dist.barrier()  # every configuration's step starts together
        t0 = time.perf_counter()
        tokens = sum(lengths)  # the minibatch's global token count normalises the loss
        for mb in plan[rank]:
            if mb:
                x, y, d = microbatch([lengths[i] for i in mb], args.vocab, seed=step * 1000 + sum(mb))
                weight = 1.0
            else:  # LB-Micro padding: join the step's collectives with a zero-weight dummy
                x, y, d = microbatch([8], args.vocab, seed=0)
                weight = 0.0
            (F.cross_entropy(model(x, d), y, reduction="sum") * (weight / tokens)).backward()
        if decoupled:
            odc.sync(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--docs-per-step", type=int, default=10)
    p.add_argument("--mean-len", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=768, help="token cap per microbatch")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--balanced", action="store_true", help="constant document lengths (control)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("cpu:odc")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    cost = balance.TransformerCost(hidden_size=args.d_model, num_layers=args.layers,
                                   intermediate_size=4 * args.d_model, num_heads=args.heads,
                                   vocab_size=args.vocab, gated_mlp=False)
    docs = [make_documents(args.docs_per_step, args.seed * 100 + s, args.balanced, args.mean_len,
                           args.max_tokens) for s in range(args.steps)]
    plans = {"exact_lbmicro": [balance.lb_micro(d, world, args.max_tokens, cost) for d in docs],
             "decoupled_lbmini": [balance.lb_mini(d, world, args.max_tokens, cost) for d in docs]}
    results = {}
    for name, plan in plans.items():
        decoupled = name.startswith("decoupled")
        torch.manual_seed(args.seed)  # the same initial weights for every configuration
        model = PackedLM(args.vocab, args.d_model, args.heads, args.layers)
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if decoupled:
            odc.decouple(model, opt)
        train_steps(model, opt, plan[:1], docs[:1], args, decoupled)  # warm-up, not timed
        before = odc.metrics(model) if decoupled else None
        times = train_steps(model, opt, plan[1:], docs[1:], args, decoupled)
        stats = [balance.plan_stats(pl, d, cost) for pl, d in zip(plan[1:], docs[1:])]
        res = {"step_times_s": times, "mean_step_s": sum(times) / len(times),
               "tokens_per_s": sum(sum(d) for d in docs[1:]) / sum(times),
               "per_rank_microbatches": [st["per_rank_microbatches"] for st in stats],
               "predicted_sync_time": sum(st["sync_time"] for st in stats),
               "predicted_decoupled_time": sum(st["decoupled_time"] for st in stats)}
        if decoupled:
            after = odc.metrics(model)
            busy = after["busy_s"] - before["busy_s"]
            wait = after["sync_wait_s"] - before["sync_wait_s"]
            res.update(busy_s=busy, sync_wait_s=wait, bubble_rate=wait / (busy + wait))
        # every rank's step times: the step time that counts is the slowest rank's
        gathered = [None] * world
        dist.all_gather_object(gathered, times)
        res["step_times_s"] = [max(ts[k] for ts in gathered) for k in range(len(times))]
        res["mean_step_s"] = sum(res["step_times_s"]) / len(times)
        res["tokens_per_s"] = sum(sum(d) for d in docs[1:]) / sum(res["step_times_s"])
        results[name] = res
        if rank == 0:
            print(f"[train_imbalanced] {name:17s} {res['tokens_per_s']:9.0f} tokens/s, "
                  f"step {res['mean_step_s'] * 1e3:7.1f} ms"
                  + (f", bubble {100 * res['bubble_rate']:.1f}%" if decoupled else ""), flush=True)
        del model, opt
    ex, de = results["exact_lbmicro"], results["decoupled_lbmini"]
    summary = {
        "speedup_decoupled_lbmini_vs_exact_lbmicro": de["tokens_per_s"] / ex["tokens_per_s"],
        # the workload's ideal: sum over LB-Micro steps of the slowest rank vs the slowest
        # rank's LB-Mini total (cost model)
        "ideal_speedup_predicted": ex["predicted_sync_time"] / de["predicted_decoupled_time"],
    }
    summary["fraction_of_ideal"] = ((summary["speedup_decoupled_lbmini_vs_exact_lbmicro"] - 1)
                                    / max(summary["ideal_speedup_predicted"] - 1, 1e-9))
    if rank == 0:
        print(f"[train_imbalanced] speedup {summary['speedup_decoupled_lbmini_vs_exact_lbmicro']:.2f}x "
              f"(predicted ideal {summary['ideal_speedup_predicted']:.2f}x)", flush=True)
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                    text=True, timeout=10).stdout.strip()
        except OSError:
            commit = ""
        kind = os.environ.get("ODC_BENCH_KIND", f"cpu-x{world}")
        date = datetime.date.today().strftime("%Y%m%d")
        out = Path(args.out_dir) / f"train_imbalanced_{kind}{'_balanced' if args.balanced else ''}_{date}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "benchmark": "train_imbalanced", "kind": kind, "world_size": world,
            "device": "cpu", "torch": torch.__version__,
            "commit": os.environ.get("ODC_COMMIT") or commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "args": vars(args), "documents": docs, "results": results, "summary": summary}, indent=1))
        print(f"[train_imbalanced] wrote {out}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
