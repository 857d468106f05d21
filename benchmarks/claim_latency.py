#!/usr/bin/env python3
"""Latency of dynamic balancing's take: one atomic fetch-add on the group's store.

    torchrun --standalone --nproc-per-node=2 benchmarks/claim_latency.py     # CPU or GPUs

Every rank takes from one shared counter as fast as it can (the contended case: all ranks
at once), then from a counter of its own (uncontended); per take the host-side round trip
of ``OdcBackend.claim`` (torchrun's TCPStore). Rank 0 writes
``<out-dir>/claim_latency_<kind>_<date>.json``. A microbatch of long-context
training takes 0.1-3 s; a take costs one such round trip (two when taking another rank's).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

import _meta
from torch_odc_backend import balance


def timed(backend, key: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        backend.claim(key, 1)
        out.append(time.perf_counter() - t)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--takes", type=int, default=2000)
    p.add_argument("--out-dir", default=str(_meta.default_out_dir()), help=_meta.OUT_DIR_HELP)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("cpu:gloo,cuda:odc" if cuda else "cpu:odc")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    backend, _ = balance._odc_backend_of(None)
    timed(backend, "warmup", 50)
    dist.barrier()
    shared = timed(backend, "shared", args.takes)
    dist.barrier()
    own = timed(backend, f"own{rank}", args.takes)
    stats = {}
    for name, xs in (("shared", shared), ("own", own)):
        xs = sorted(xs)
        stats[name] = {"median_us": statistics.median(xs) * 1e6, "p99_us": xs[int(0.99 * len(xs))] * 1e6,
                       "mean_us": statistics.fmean(xs) * 1e6}
    gathered = [None] * world
    dist.all_gather_object(gathered, stats)
    total = backend.claim("shared", 0)
    if rank == 0:
        assert total == world * args.takes, (total, world * args.takes)  # every take counted once
        kind = _meta.machine_kind(device, world)
        out = _meta.result_path(args.out_dir, "claim_latency", kind)
        out.write_text(json.dumps({"benchmark": "claim_latency", "kind": kind, "world_size": world,
                                   "takes_per_rank": args.takes, **_meta.stamp(device), "per_rank": gathered},
                                  indent=1))
        for r, st in enumerate(gathered):
            print(f"[claim_latency] rank {r}: shared counter median {st['shared']['median_us']:.0f} us "
                  f"(p99 {st['shared']['p99_us']:.0f}), own counter median {st['own']['median_us']:.0f} us",
                  flush=True)
        print(f"[claim_latency] wrote {out}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
