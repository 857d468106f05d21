#!/usr/bin/env python3
"""Which backend each live process group uses, and odc's counters: ``group_report()``.

For checking recipes in-process (``megatron_fsdp_recipe.py`` calls it before it destroys its
groups). For a trainer whose code you do not touch, set ``ODC_STATS_DIR=DIR`` instead: at
exit every process writes ``DIR/odc_stats_rank<R>.json`` with its odc groups and their
counters, e.g. ``all_gather_ops``, ``reduce_scatter_ops`` (FSDP's one-sided collectives),
``delegated_ops``, ``own_*_ops`` (``torchtitan_debug.py`` does this): ``read_stats_dir(DIR)``
reads them back, ``summed_counters`` sums a rank's over its groups.
"""
from __future__ import annotations

import json
from pathlib import Path


def read_stats_dir(folder: Path) -> list[dict]:
    """The records ``ODC_STATS_DIR=folder`` left, one per rank in rank order (none when no
    process made an odc group, or the folder does not exist)."""
    return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("odc_stats_rank*.json"))]


def summed_counters(record: dict) -> dict:
    """One rank's odc counters summed over its groups (a record of ``read_stats_dir``)."""
    total: dict = {}
    for group in record["groups"]:
        for k, v in group["stats"].items():
            total[k] = total.get(k, 0) + v
    return total


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
