#!/usr/bin/env python3
"""Where a profiled step's GPU sat idle: gaps on the compute stream of Chrome traces.

    python3 benchmarks/trace_gaps.py trace_a.json.gz [trace_b.json.gz ...] [--out gaps.json]

For each trace (``train_imbalanced.py --profile --trace-dir``): the compute stream (the
stream with the most kernel time), its busy time and span, every gap longer than
``--min-gap-ms`` during which no kernel or copy ran on that stream, and for the longest
gaps the CUDA runtime calls the host made just before the launch that ended the gap (a
gap that follows host-only work shows no runtime call for its whole length).
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cuda_runtime", "cuda_driver")


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def analyse(events: list[dict], min_gap_us: float, top: int) -> dict:
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    host = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATS),
                  key=lambda e: e["ts"])
    by_stream: dict = defaultdict(list)
    for e in gpu:
        by_stream[e["tid"]].append(e)
    if not by_stream:
        return {"compute_stream": None, "kernels": 0, "busy_ms": 0.0, "span_ms": 0.0, "idle_ms": 0.0,
                "gaps": 0, "gaps_total_ms": 0.0, "longest": []}
    stream, evs = max(by_stream.items(), key=lambda kv: sum(e["dur"] for e in kv[1]))
    evs.sort(key=lambda e: e["ts"])
    busy = sum(e["dur"] for e in evs)
    span = evs[-1]["ts"] + evs[-1]["dur"] - evs[0]["ts"]
    launch_of: dict = {}  # correlation id -> the launching call (the runtime one, not a nested driver call)
    for e in host:
        c = e.get("args", {}).get("correlation")
        if c is not None and (c not in launch_of or e.get("cat") == "cuda_runtime"):
            launch_of[c] = e
    gaps = []
    for a, b in zip(evs, evs[1:]):
        g = b["ts"] - (a["ts"] + a["dur"])
        if g >= min_gap_us:
            gaps.append((g, a, b))
    gaps.sort(key=lambda x: -x[0])
    rows = []
    for g, a, b in gaps[:top]:
        launch = launch_of.get(b.get("args", {}).get("correlation"))
        before = []
        if launch is not None:
            prior = [e for e in host if e["tid"] == launch["tid"] and e["ts"] < launch["ts"]][-5:]
            before = [{"call": e["name"], "ended_ms_before_launch": (launch["ts"] - e["ts"] - e["dur"]) / 1e3}
                      for e in prior]
        rows.append({"gap_ms": g / 1e3, "after": a["name"][:80], "ended_by": b["name"][:80],
                     "ended_by_launch": launch["name"] if launch else None, "host_calls_before": before})
    return {"compute_stream": stream, "kernels": len(evs), "busy_ms": busy / 1e3, "span_ms": span / 1e3,
            "idle_ms": (span - busy) / 1e3, "gaps": len(gaps), "gaps_total_ms": sum(g for g, _, _ in gaps) / 1e3,
            "longest": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--min-gap-ms", type=float, default=2.0)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    out = {}
    for t in args.traces:
        r = analyse(load(t), args.min_gap_ms * 1e3, args.top)
        out[t.name] = r
        print(f"{t.name}: compute stream {r['compute_stream']}: busy {r['busy_ms']:.0f} ms of "
              f"{r['span_ms']:.0f} ms; {r['gaps']} gaps >= {args.min_gap_ms} ms, {r['gaps_total_ms']:.0f} ms")
        for row in r["longest"][:3]:
            calls = ", ".join(f"{c['call']} ({c['ended_ms_before_launch']:.1f} ms before)"
                              for c in row["host_calls_before"][-2:])
            print(f"    {row['gap_ms']:6.1f} ms, ended by {row['ended_by_launch']}; host calls before: {calls}")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
