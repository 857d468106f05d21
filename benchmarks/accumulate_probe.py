#!/usr/bin/env python3
"""Throughput of decoupled mode's put-accumulate alone, per ODC_ACCUMULATE_BLOCKS value.

    torchrun --standalone --nproc-per-node=2 benchmarks/accumulate_probe.py            # GPUs
    torchrun --standalone --nproc-per-node=2 benchmarks/accumulate_probe.py --device cpu

Each rank adds a gradient of ``--numel`` elements (the reduce-scatter input of one FSDP
group: world x shard rows) into the owners' fp32 accumulators, ``--iters`` times, and the
accumulators are checked against the exact sum. Reported per block count: GB/s of gradient
rows added (local and remote shares together) and the time of one call, from CUDA events on
the caller's stream. The end-to-end runs suggested only ~4-5 GB/s (benchmarks/NOTES.md,
"Decoupled mode on GPUs"); this isolates the kernel. Rank 0 writes
``benchmarks/results/accumulate_probe_<kind>_<date>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import _meta
import torch_odc_backend  # noqa: F401  (registers odc)

REPO = Path(__file__).resolve().parents[1]


def measure(device, world: int, rank: int, numel: int, dtype, iters: int, blocks: int) -> dict:
    os.environ["ODC_ACCUMULATE_BLOCKS"] = str(blocks)  # read when the group's backend starts
    pg = dist.new_group(backend="cpu:gloo,cuda:odc" if device.type == "cuda" else "cpu:odc")
    backend = pg._get_backend(device)
    shard = numel // world
    arena = backend.create_arena(device, [shard], [torch.empty(0, dtype=dtype).element_size()], [shard])
    arena.publish(0, torch.zeros(shard, dtype=dtype, device=device))
    arena.announce(1)
    rows = torch.full((world * shard,), float(rank + 1), dtype=dtype, device=device)
    arena.accumulate(0, rows)  # warm-up (counted in the check below)
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        arena.accumulate(0, rows)
    if device.type == "cuda":
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        seconds = time.perf_counter() - t0
    arena.finish(1)
    acc = torch.empty(shard, dtype=torch.float32, device=device)
    arena.take(0, acc)
    expect = (iters + 1) * world * (world + 1) / 2
    bad = int((acc != expect).sum().item())
    dist.destroy_process_group(pg)
    added = iters * world * shard * rows.element_size()
    return {"blocks": blocks, "seconds": seconds, "per_call_ms": 1e3 * seconds / iters,
            "GBps": added / seconds / 1e9, "wrong_elements": bad}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--numel", type=int, default=None,
                   help="reduce-scatter input elements (default: one Qwen2-1.5B layer, 46.8M; CPU 1M)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--blocks", default="1,4,16,32,64")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args()

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("cpu:gloo,cuda:odc")
    else:
        device = torch.device("cpu")
        dist.init_process_group("cpu:odc")
    world, rank = dist.get_world_size(), dist.get_rank()
    numel = args.numel or (46_800_000 if use_cuda else 1 << 20)
    dtype = getattr(torch, args.dtype)
    rows = [measure(device, world, rank, numel, dtype, args.iters, int(b)) for b in args.blocks.split(",")]
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        for k, r in enumerate(rows):
            worst = max(g[k]["per_call_ms"] for g in gathered)
            print(f"[accumulate_probe] blocks {r['blocks']:4d}: {r['GBps']:8.2f} GB/s on rank 0, "
                  f"slowest rank {worst:8.3f} ms per call, wrong elements "
                  f"{sum(g[k]['wrong_elements'] for g in gathered)}", flush=True)
        kind = _meta.machine_kind(device, world)
        out = _meta.result_path(args.out_dir, "accumulate_probe", kind)
        out.write_text(json.dumps({"benchmark": "accumulate_probe", "kind": kind, "world_size": world,
                                   "numel": numel, "dtype": args.dtype, "iters": args.iters,
                                   **_meta.stamp(device), "per_rank": gathered}, indent=1))
        print(f"[accumulate_probe] wrote {out}", flush=True)
    ok = all(r["wrong_elements"] == 0 for g in gathered for r in g)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
