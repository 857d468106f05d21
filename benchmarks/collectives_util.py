"""Sizes, statistics and the fixed texts of the collectives benchmark (benchmarks/collectives.py)."""
from __future__ import annotations

import argparse
import os
import re
import statistics
from pathlib import Path
from typing import Callable

import _meta

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_SIZES = [(1 << i) * MiB for i in range(10)]  # 1 MiB .. 512 MiB
CPU_DEFAULT_SIZES = [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB]
OPS = ("all_gather", "reduce_scatter")
REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT_DIR = _meta.default_out_dir()  # outside the checkout; --out-dir benchmarks/results: the headline files


# --------------------------------------------------------------------------- sizes
def parse_size(text: str) -> int:
    """'1M', '4MiB', '512k', '1G', '1048576B'; a bare number means MiB."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(i?b?)\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 1M, 64MiB, 512K, 1G)")
    num, unit, suffix = float(m.group(1)), m.group(2), m.group(3)
    if not unit:
        mult = 1 if suffix == "b" else MiB
    else:
        mult = {"k": KiB, "m": MiB, "g": GiB}[unit]
    return int(num * mult)


def parse_sizes(text: str) -> list[int]:
    return [parse_size(t) for t in text.split(",") if t.strip()]


def size_label(nbytes: int) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{name}"
    return f"{nbytes}B"


def median(xs):
    return statistics.median(xs) if xs else None


def percentile(xs, q):
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


# --------------------------------------------------------------------------- odc's engine per size
SMS_SOURCE = ("reported by the backend for one call of each size, after the timed trials (the "
              "group's stats: fused_ops / fused_blocks, copy_engine_ops / copy_engine_blocks); "
              "sms = the most thread blocks the call held at once per rank (the fused kernel's grid; "
              "on the copy-engine path each lane's largest kernel, the lanes running at once, plus "
              "one flag-kernel block per lane that ran one), an upper bound on SMs (one block per SM)")
_ENGINE_KEYS = ("fused_ops", "fused_blocks", "copy_engine_ops", "copy_engine_blocks",
                "all_gather_push_ops")


def engine_from_stats(before: dict, after: dict) -> dict:
    """odc's engine and SMs for the calls made between two snapshots of the group's stats."""
    d = {k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in _ENGINE_KEYS}
    if d["fused_ops"] and d["copy_engine_ops"]:
        engine = "mixed"
    elif d["fused_ops"]:
        engine = "fused-kernel"
    elif d["copy_engine_ops"]:
        engine = "copy-engine"
    else:
        return {"engine": "none", "sms": 0}
    ops = d["fused_ops"] + d["copy_engine_ops"]
    out = {"engine": engine, "sms": round((d["fused_blocks"] + d["copy_engine_blocks"]) / ops, 1)}
    if d["all_gather_push_ops"]:  # zero-copy all-gathers that wrote the peers' outputs (ODC_AG_PUSH)
        out["pushed"] = True
    return out


def guesses_from_stats(before: dict, after: dict) -> dict:
    """Pushed all-gathers on the copy engines (ODC_AG_PUSH=1): the pushes made to a guessed
    place between two snapshots of the group's stats, and those the device confirmed (the
    others were written by the SM copy behind them); empty where none was made."""
    d = {k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in ("guessed_pushes", "guessed_push_hits")}
    return d if d["guessed_pushes"] else {}


FLOOR_DEFINITION = (
    "per size, every rank at once moves the least bytes the collective needs for it, on local "
    "buffers: all_gather copies (W-1)/W*S bytes; reduce_scatter reads W chunks of S/W bytes and "
    "writes their sum (S/W); each with the copy engine (cudaMemcpyAsync; for reduce_scatter the "
    "W-1 chunks staged, then summed) and with an SM kernel (mul by 1 / torch.sum); floor_us = the "
    "faster median (floor_engine names it: floor_ce or floor_sm); timed like odc, interleaved "
    "with it: all ranks start together, per trial the slowest rank, median over trials")
HOST_US_DEFINITION = ("host wall time per call to issue ops_per_trial back-to-back odc calls, "
                      "before any synchronisation (includes any blocking inside the call); per trial "
                      "the slowest rank, median over trials")


def with_env(name: str, value: str, create: Callable):
    """create() with os.environ[name] = value, then the old value back: odc's knobs are read
    when a group is created."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        return create()
    finally:
        if before is None:
            os.environ.pop(name)
        else:
            os.environ[name] = before
