#!/usr/bin/env python3
"""Run a trainer module unmodified, as ``python -m MODULE`` would, and record which backend
each process group used and odc's counters, just before the trainer destroys its groups.

For checking recipes, not for training: the trainer's code is untouched (this launcher
only wraps ``torch.distributed.destroy_process_group`` to take a last look at the groups),
and the backend still comes from wherever the trainer takes it (for a zero-code-change
run: ``ODC_DEFAULT_BACKEND``). Under torchrun::

    ODC_DEFAULT_BACKEND=cuda torchrun --standalone --nproc-per-node=2 \\
        examples/recipes/odc_stats.py --out STATS_DIR -m torchtitan.train ARGS...

writes ``STATS_DIR/odc_stats_rank<R>.json``: for every group of the process, its ranks and,
per device type, the backend's name and (odc) its counters, e.g. ``all_gather_ops``,
``reduce_scatter_ops`` (FSDP's one-sided collectives), ``delegated_ops``, ``own_*_ops``.
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import sys


def group_report() -> list[dict]:
    """Every live process group of this process: ranks, and per device its backend."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    groups = list(getattr(c10d._world, "pg_map", {}).keys()) or [dist.group.WORLD]
    report = []
    for pg in groups:
        entry = {"ranks": dist.get_process_group_ranks(pg),
                 "default": pg is dist.group.WORLD, "backends": {}}
        for device in ("cpu", "cuda"):
            try:
                backend = pg._get_backend(torch.device(device))
            except Exception:  # noqa: BLE001 - no backend for this device in this group
                continue
            info = {"name": backend.name()}
            if info["name"] == "odc":
                info["stats"] = {k: int(v) for k, v in dict(backend.stats()).items()}
            entry["backends"][device] = info
        report.append(entry)
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for odc_stats_rank<R>.json")
    parser.add_argument("-m", dest="module", required=True, help="the trainer module to run")
    args, rest = parser.parse_known_args(argv)

    import torch.distributed as dist

    original = dist.destroy_process_group
    done = []

    def record() -> None:
        if done or not dist.is_initialized():
            return
        done.append(True)
        rank = dist.get_rank()
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"odc_stats_rank{rank}.json")
        with open(path, "w") as f:
            json.dump({"rank": rank, "world": dist.get_world_size(),
                       "odc_default_backend": os.environ.get("ODC_DEFAULT_BACKEND", ""),
                       "groups": group_report()}, f, indent=1)

    def destroy_process_group(group=None):
        if group is None:
            try:
                record()
            except Exception as e:  # noqa: BLE001 - never break the trainer's teardown
                print(f"odc_stats: could not record the groups: {e!r}", file=sys.stderr)
        return original(group)

    dist.destroy_process_group = destroy_process_group
    sys.argv = [args.module, *rest]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
