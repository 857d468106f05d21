#!/usr/bin/env python3
"""First GPU experiments for the NVSHMEM transport (docs/nvshmem_transport.md, section 5).

    ODC_WITH_NVSHMEM=1 MAX_JOBS=16 python3 -m pip install --no-build-isolation --no-deps -e .
    torchrun --standalone --nproc-per-node=2 benchmarks/nvshmem_probe.py [--torch-symm-mem]

1. host-library initialisation through our own unique-id exchange; PE numbering;
2. (``--torch-symm-mem``) coexistence: PyTorch's symmetric memory with its NVSHMEM backend
   after ours (does it join our world?);
3. put-with-signal + stream signal wait between neighbours, checked, at several sizes.

Rank 0 writes ``benchmarks/results/nvshmem_probe_<kind>_<date>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import _meta
import torch_odc_backend  # noqa: F401  (registers odc; eager module loading)
from torch_odc_backend import nvshmem as odc_nvshmem

REPO = Path(__file__).resolve().parents[1]


def step(results: dict, name: str, fn):
    try:
        results[name] = {"ok": True, "value": fn()}
    except Exception as e:  # noqa: BLE001  (a probe records failures and goes on)
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()[-2000:]}
    if dist.get_rank() == 0:
        print(f"[nvshmem_probe] {name}: {json.dumps(results[name])[:400]}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8,65536,1048576,33554432")
    p.add_argument("--torch-symm-mem", action="store_true")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args()

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("cpu:gloo,cuda:nccl")
    res: dict = {"available": odc_nvshmem.available()}
    step(res, "status_before", odc_nvshmem.status)
    step(res, "init", lambda: odc_nvshmem.init(slab_bytes=1 << 30))
    step(res, "status_after", odc_nvshmem.status)
    for size in (int(s) for s in args.sizes.split(",")):
        step(res, f"ring_selftest_{size}", lambda: odc_nvshmem.ring_selftest(size))
    if args.torch_symm_mem:
        def torch_symm():
            import torch.distributed._symmetric_memory as symm_mem

            symm_mem.set_backend("NVSHMEM")
            t = symm_mem.empty(1024, device="cuda")
            h = symm_mem.rendezvous(t, dist.group.WORLD.group_name)
            return {"rank": h.rank, "world": h.world_size, "status": odc_nvshmem.status()}

        step(res, "torch_symm_mem_after_odc", torch_symm)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, res)
    if dist.get_rank() == 0:
        device = torch.device("cuda", local)
        kind = _meta.machine_kind(device, dist.get_world_size())
        out = _meta.result_path(args.out_dir, "nvshmem_probe", kind)
        out.write_text(json.dumps({"benchmark": "nvshmem_probe", "kind": kind, **_meta.stamp(device),
                                   "env": {k: v for k, v in os.environ.items() if k.startswith(("NVSHMEM_", "ODC_"))},
                                   "per_rank": gathered}, indent=1))
        print(f"[nvshmem_probe] wrote {out}", flush=True)
    ok = all(v.get("ok", True) for r in gathered for v in r.values() if isinstance(v, dict))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
