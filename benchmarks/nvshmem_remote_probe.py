#!/usr/bin/env python3
"""Does NVSHMEM reach this host's peers through a remote transport, and do odc's routed
collectives run over it? (the network peers' path, exercised on one machine)

    ODC_TRANSPORT=nvshmem [NVSHMEM_DISABLE_P2P=1 NVSHMEM_REMOTE_TRANSPORT=ucx ...] \\
        torchrun --standalone --nproc-per-node=2 benchmarks/nvshmem_remote_probe.py --out X.json

Ranks may share GPUs (rank r uses GPU r % count). Steps, each recorded with its error
instead of stopping the probe: NVSHMEM's state after the default group's odc backend
brought it up (init status 3/4: several PEs per GPU), whether NVSHMEM maps the next PE
(no: a network peer), the put-with-signal self-test, then odc's all-gather and
reduce-scatter at several sizes checked against their exact results, and the routed /
staged copy counters. Rank 0 writes the JSON (every rank's steps, the NVSHMEM_* / UCX_* /
ODC_* environment).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

import _meta
from torch_odc_backend import nvshmem as odc_nvshmem


def step(res: dict, name: str, fn):
    t0 = time.perf_counter()
    try:
        res[name] = {"ok": True, "value": fn()}
    except Exception as e:  # noqa: BLE001  (a probe records failures and goes on)
        res[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:1500],
                     "traceback": traceback.format_exc()[-1500:]}
    res[name]["s"] = round(time.perf_counter() - t0, 3)
    print(f"[remote_probe rank {dist.get_rank()}] {name}: {json.dumps(res[name])[:300]}", flush=True)


def collectives(numel: int, dtype: torch.dtype) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()

    def rows_of(r):  # exact in bf16 and fp32: small integers
        return ((torch.arange(world * numel, device="cuda") * (r + 1)) % 13).to(dtype)

    shard = torch.full((numel,), float(rank + 1), device="cuda", dtype=dtype)
    out = torch.empty(world * numel, device="cuda", dtype=dtype)
    dist.all_gather_into_tensor(out, shard)
    red = torch.empty(numel, device="cuda", dtype=dtype)
    dist.reduce_scatter_tensor(red, rows_of(rank))
    expect = sum(rows_of(r).float() for r in range(world)).view(world, -1)[rank]
    torch.cuda.synchronize()
    ag_ok = all(bool((out[i * numel:(i + 1) * numel] == i + 1).all()) for i in range(world))
    return {"all_gather_exact": ag_ok, "reduce_scatter_max_err": float((red.float() - expect).abs().max())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="256,262147,12582912", help="elements per rank")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group("cpu:gloo,cuda:odc")  # ODC_TRANSPORT=nvshmem: brings NVSHMEM up
    res: dict = {"available": odc_nvshmem.available()}
    step(res, "status_after_init", odc_nvshmem.status)
    if odc_nvshmem.status()["init_status"] != 3:  # limited MPG: NVSHMEM aborts on a barrier
        step(res, "ring_selftest_1MiB", lambda: odc_nvshmem.ring_selftest(1 << 20))
    for n in (int(x) for x in args.sizes.split(",")):
        for dt in (torch.float32, torch.bfloat16):
            step(res, f"collectives_{n}_{str(dt)[6:]}", lambda: collectives(n, dt))
    step(res, "status_end", odc_nvshmem.status)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, res)
    if dist.get_rank() == 0:
        device = torch.device("cuda", torch.cuda.current_device())
        env = {k: v for k, v in os.environ.items() if k.startswith(("NVSHMEM_", "ODC_", "UCX_"))}
        doc = {"benchmark": "nvshmem_remote_probe", **_meta.stamp(device), "env": env,
               "ranks_per_gpu": dist.get_world_size() / max(1, torch.cuda.device_count()),
               "per_rank": gathered}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    ok = all(v.get("ok", True) for r in gathered for v in r.values() if isinstance(v, dict))
    ok = ok and all(r[k]["value"]["all_gather_exact"] and r[k]["value"]["reduce_scatter_max_err"] == 0
                    for r in gathered for k in r if k.startswith("collectives_") and r[k]["ok"])
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
