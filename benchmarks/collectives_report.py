"""The collectives benchmark's output: the summary of its rows, the JSON file, the table it
prints and the PNG."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from _png import save_png
from collectives_util import FLOOR_DEFINITION, HOST_US_DEFINITION, MiB, OPS, SMS_SOURCE, size_label


def _by_key(rows: list[dict]) -> dict:
    """(op, backend, size_bytes) -> the row, for the all-gather / reduce-scatter rows."""
    return {(r["op"], r["backend"], r["size_bytes"]): r for r in rows if r["op"] in OPS}


def _sizes(by: dict, op: str) -> list[int]:
    return sorted({k[2] for k in by if k[0] == op})


def _has(by: dict, backend: str) -> bool:
    return any(k[1] == backend for k in by)


NCCL_VARIANTS = ("nccl", "nccl_registered", "nccl_symmetric", "nccl_ce")


def _nccl_best(by: dict, op: str, sz: int) -> dict | None:
    """The row of the NCCL variant with the highest busbw at ``op`` and ``sz`` (None: none measured)."""
    rows = [by[(op, b, sz)] for b in NCCL_VARIANTS if (op, b, sz) in by]
    return max(rows, key=lambda r: r["busbw_GBps"]) if rows else None


# --------------------------------------------------------------------------- summary
def _vs_reference(by: dict, b: str, ref: str) -> dict:
    """busbw ratio of ``b`` to the reference per size, its least at >= 4 MiB, latency ratio at 1 MiB."""
    ratio: dict = {}
    lat1: dict = {}
    min4: dict = {}
    for op in OPS:
        sizes = _sizes(by, op)
        ratio[op] = {}
        for sz in sizes:
            o, c = by.get((op, b, sz)), by.get((op, ref, sz))
            if o and c and c["busbw_GBps"]:
                ratio[op][size_label(sz)] = o["busbw_GBps"] / c["busbw_GBps"]
        big = [ratio[op][size_label(sz)] for sz in sizes if sz >= 4 * MiB and size_label(sz) in ratio[op]]
        min4[op] = min(big) if big else None
        o, c = by.get((op, b, MiB)), by.get((op, ref, MiB))
        lat1[op] = o["latency_us"] / c["latency_us"] if o and c else None
    suffix = "" if b == "odc" else f"_{b}"  # keys of the odc group keep their names; others add theirs
    return {f"busbw_ratio_{b}_vs_{ref}": ratio, f"min_busbw_ratio_ge_4MiB{suffix}": min4,
            f"latency_ratio_{b}_vs_{ref}_1MiB": lat1}


def _registered_vs_registered(by: dict) -> dict:
    if not (_has(by, "nccl_registered") and _has(by, "odc_registered")):
        return {}
    return {"busbw_ratio_odc_registered_vs_nccl_registered": {
        op: {size_label(sz): by[(op, "odc_registered", sz)]["busbw_GBps"] / by[(op, "nccl_registered", sz)]["busbw_GBps"]
             for sz in _sizes(by, op) if (op, "odc_registered", sz) in by and (op, "nccl_registered", sz) in by}
        for op in OPS}}


def _vs_nccl_best(by: dict) -> dict:
    """odc's (and odc_registered's) busbw over the best NCCL variant's, per op and size, and
    which variant that was."""
    if not any(_has(by, b) for b in NCCL_VARIANTS):
        return {}
    mine = [b for b in ("odc", "odc_registered") if _has(by, b)]
    s: dict = {f"busbw_ratio_{b}_vs_nccl_best": {op: {} for op in OPS} for b in mine}
    s["nccl_best_backend"] = {op: {} for op in OPS}
    for op in OPS:
        for sz in _sizes(by, op):
            best = _nccl_best(by, op, sz)
            if not best or not best["busbw_GBps"]:
                continue
            s["nccl_best_backend"][op][size_label(sz)] = best["backend"]
            for b in mine:
                if (op, b, sz) in by:
                    s[f"busbw_ratio_{b}_vs_nccl_best"][op][size_label(sz)] = (
                        by[(op, b, sz)]["busbw_GBps"] / best["busbw_GBps"])
    return s


def _odc_per_size(by: dict, primary: str, cuda: bool) -> dict:
    """odc's latency, host us, engine / SMs and floor per size, on its ``primary`` path."""
    keys = ["latency_us", "host_us"] + (["engine", "sms"] if cuda else []) + (
        ["floor_us", "floor_engine", "ratio_to_floor"] if _has(by, "floor") else [])
    s = {key: {op: {} for op in OPS} for key in keys}
    for op in OPS:
        for sz in _sizes(by, op):
            label, o, f = size_label(sz), by.get((op, primary, sz)), by.get((op, "floor", sz))
            if f:
                s["floor_us"][op][label] = f["latency_us"]
                s["floor_engine"][op][label] = f["floor_engine"]
            if o:
                s["latency_us"][op][label] = o["latency_us"]
                s["host_us"][op][label] = o.get("host_us")
                if "odc_engine" in o:
                    s["engine"][op][label] = o["odc_engine"]
                    s["sms"][op][label] = o["odc_sms"]
            if o and f and f["latency_us"]:
                s["ratio_to_floor"][op][label] = o["latency_us"] / f["latency_us"]
    return s


def _odc_staged(by: dict) -> dict:
    """The staged path's latency, host us and floor ratio (beside the zero-copy one's)."""
    st = {key: {op: {} for op in OPS} for key in ("latency_us", "host_us", "ratio_to_floor")}
    for (op, b, sz), o in by.items():
        if b != "odc":
            continue
        f = by.get((op, "floor", sz))
        st["latency_us"][op][size_label(sz)] = o["latency_us"]
        st["host_us"][op][size_label(sz)] = o.get("host_us")
        if f and f["latency_us"]:
            st["ratio_to_floor"][op][size_label(sz)] = o["latency_us"] / f["latency_us"]
    return st


def _odc_summary(by: dict, cuda: bool) -> dict:
    """odc per size: the zero-copy path where it was measured (odc_staged then holds the staged
    path's), else the staged one."""
    primary = "odc_registered" if _has(by, "odc_registered") else "odc"
    s = {"odc_path": "registered (zero-copy)" if primary == "odc_registered"
         else "plain tensors (read in place once mapped: ODC_ZERO_COPY)" if cuda else "staged"}
    if not _has(by, primary):
        return s
    s.update(_odc_per_size(by, primary, cuda))
    if primary != "odc" and _has(by, "odc"):
        s["odc_staged"] = _odc_staged(by)
    if _has(by, "floor"):
        s["floor_definition"] = FLOOR_DEFINITION
    if cuda:
        s["sms_source"] = SMS_SOURCE
    s["host_us_definition"] = HOST_US_DEFINITION
    return s


def _gemm_summary(rows: list[dict], others: list[str], ref: str) -> dict:
    gemm = [r for r in rows if r["op"] == "gemm"]
    if not gemm:
        return {}
    slow: dict = {}
    for g in gemm:
        if g["backend"] != "alone":
            slow.setdefault(g["backend"], {})[g["ag_size"]] = g["slowdown"]
    s = {"gemm_slowdown": slow}
    for b in others:
        gratio: dict = {}
        for label in slow.get(b, {}):
            so, sc = slow[b][label], slow.get(ref, {}).get(label)
            gratio[label] = so / sc if sc is not None and sc > 0 else None
        s[f"gemm_slowdown_ratio_{b}_vs_{ref}"] = gratio
    return s


def summarize(rows: list[dict], errors: list[str], order: list[str], ref: str, cuda: bool) -> dict:
    """The result's "summary": odc (and the other compared backends) against the reference."""
    by = _by_key(rows)
    others = [b for b in order if b != ref]
    s: dict = {}
    for b in others:
        s.update(_vs_reference(by, b, ref))
    s.update(_registered_vs_registered(by))
    s.update(_vs_nccl_best(by))
    s.update(_odc_summary(by, cuda))
    s["peak_busbw_GBps"] = {op: {b: max((r["busbw_GBps"] for k, r in by.items() if k[0] == op and k[1] == b),
                                        default=None) for b in order} for op in OPS}
    s.update(_gemm_summary(rows, others, ref))
    checks = [r for r in rows if r["op"] == "check"]
    flags = [v for r in checks for k, v in r.items() if "_equal_" in k]
    s["all_checks_passed"] = bool(flags) and all(flags) and not any("_error_" in k for r in checks for k in r)
    s["errors"] = len(errors)
    return s


def summary(ctx) -> dict:
    return summarize(ctx.rows, ctx.errors, ctx.order, ctx.ref, ctx.cuda)


# --------------------------------------------------------------------------- the JSON file
def _add_odc_backend_stats(ctx, doc: dict):
    """doc["odc_backend_stats"]: odc's counters where it has them. They are optional, so they
    never break the results file."""
    if ctx.odc_mod is None or not hasattr(ctx.odc_mod, "backend_stats"):
        return
    for call in (lambda: ctx.odc_mod.backend_stats(None, ctx.device.type),
                 lambda: ctx.odc_mod.backend_stats()):
        try:
            doc["odc_backend_stats"] = json.loads(json.dumps(call(), default=str))
            return
        except Exception:  # noqa: BLE001
            pass


def write(ctx, final: bool = False):
    """Rank 0 (re)writes the result file, atomically: a run cut short still leaves its rows."""
    if ctx.rank != 0:
        return
    doc = dict(ctx.meta)
    doc["complete"] = final
    doc["elapsed_s"] = round(time.time() - ctx.started, 1)
    doc["rows"] = ctx.rows
    doc["errors"] = ctx.errors
    doc["summary"] = summary(ctx)
    _add_odc_backend_stats(ctx, doc)
    if ctx.nvshmem is not None:  # slab use and routed get / put / signal counts
        doc["nvshmem_status"] = ctx.nvshmem.status()
    tmp = ctx.json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(ctx.json_path)


# --------------------------------------------------------------------------- the printed table
def _fmt(row, key, w, p):
    return f"{row[key]:{w}.{p}f}" if row else " " * (w - 3) + "n/a"


def _print_backends(by: dict, order: list[str], ref: str):
    """Per op and size: each backend's latency and busbw, and each one's busbw / the reference's."""
    others = [b for b in order if b != ref]
    w = max(11, *(len(b) + 6 for b in order))
    print(f"\n{'op':<15}{'size':>8} | " + " ".join(f"{b + ' us':>{w}}" for b in order) + " | "
          + " ".join(f"{b + ' busbw':>{w}}" for b in order) + " | "
          + " ".join(f"{b + '/' + ref:>{w}}" for b in others))
    for op in OPS:
        for sz in _sizes(by, op):
            rows = {b: by.get((op, b, sz)) for b in order}
            c = rows[ref]
            ratios = " ".join(f"{rows[b]['busbw_GBps'] / c['busbw_GBps']:{w}.2f}" if rows[b] and c
                              else " " * (w - 3) + "n/a" for b in others)
            print(f"{op:<15}{size_label(sz):>8} | " + " ".join(_fmt(rows[b], "latency_us", w, 1) for b in order)
                  + " | " + " ".join(_fmt(rows[b], "busbw_GBps", w, 1) for b in order) + " | " + ratios)


def _print_nccl_best(by: dict):
    """Per op and size: the best NCCL variant (highest busbw) and odc's busbw over it (the
    summary's _vs_nccl_best)."""
    s = _vs_nccl_best(by)
    mine = [b for b in ("odc", "odc_registered") if f"busbw_ratio_{b}_vs_nccl_best" in s]
    print(f"\n{'op':<15}{'size':>8} | {'nccl_best':>15} {'busbw':>8} | "
          + " ".join(f"{b + '/nccl_best':>24}" for b in mine))
    for op in OPS:
        for sz in _sizes(by, op):
            best = _nccl_best(by, op, sz)
            if not best:
                continue
            got = [s[f"busbw_ratio_{b}_vs_nccl_best"][op].get(size_label(sz)) for b in mine]
            ratios = " ".join(f"{r:24.2f}" if r is not None else f"{'n/a':>24}" for r in got)
            print(f"{op:<15}{size_label(sz):>8} | {best['backend']:>15} {best['busbw_GBps']:8.1f} | {ratios}")


def _print_floor(by: dict):
    """Per op and size: odc (staged) against the floor, its host time and engine."""
    print(f"\n{'op':<15}{'size':>8} | {'odc us':>9} {'floor us':>9} {'floor by':>9} {'odc/floor':>9} | "
          f"{'host us':>8} | odc engine (SMs, derived)")
    for op in OPS:
        for sz in _sizes(by, op):
            o, fl = by.get((op, "odc", sz)), by.get((op, "floor", sz))
            ratio = f"{o['latency_us'] / fl['latency_us']:9.2f}" if o and fl else f"{'n/a':>9}"
            eng = f"{o['odc_engine']} ({o['odc_sms']})" if o and "odc_engine" in o else "-"
            print(f"{op:<15}{size_label(sz):>8} | {_fmt(o, 'latency_us', 9, 1)} {_fmt(fl, 'latency_us', 9, 1)} "
                  f"{(fl['floor_engine'] if fl else 'n/a'):>9} {ratio} | {_fmt(o, 'host_us', 8, 1)} | {eng}")


def print_table(ctx):
    """Rank 0 prints the results: the backends, the floor, the GEMM rows and the summary."""
    if ctx.rank != 0:
        return
    by = _by_key(ctx.rows)
    _print_backends(by, ctx.order, ctx.ref)
    if sum(_has(by, b) for b in NCCL_VARIANTS) > 1:  # which NCCL path was best, per size
        _print_nccl_best(by)
    if _has(by, "floor"):
        _print_floor(by)
    for g in (r for r in ctx.rows if r["op"] == "gemm"):
        print(f"gemm {g['gemm_n']} with {g['ag_size']} all-gather [{g['backend']:>5}]: "
              f"{g['gemm_ms_per_iter']:.3f} ms/iter, slowdown {100 * g['slowdown']:6.2f}%"
              + (f", ag covered gemm: {g['ag_covered_gemm']}" if "ag_covered_gemm" in g else ""))
    s = summary(ctx)
    print("summary:", json.dumps(s, indent=1, default=str), flush=True)


# --------------------------------------------------------------------------- plotting
def plot_results(json_path: str | os.PathLike, png_path: str | os.PathLike | None = None) -> Path | None:
    """Draw busbw vs size (both ops, both backends, log-x) beside the JSON file."""
    json_path = Path(json_path)
    png_path = Path(png_path) if png_path else json_path.with_suffix(".png")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[collectives] matplotlib not available: no PNG", file=sys.stderr)
        return None
    data = json.loads(json_path.read_text())
    ref = data.get("reference_backend", "nccl")
    rows = [r for r in data.get("rows", []) if r.get("op") in OPS and r.get("busbw_GBps") is not None]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    styles = {"odc": dict(color="tab:red", marker="o"), "odc_nvshmem": dict(color="tab:green", marker="^"),
              "odc_staged_push": dict(color="tab:orange", marker="v"),
              "odc_staged": dict(color="tab:brown", marker="<"),
              "odc_registered": dict(color="tab:purple", marker="D"),
              ref: dict(color="tab:blue", marker="s"), "nccl_registered": dict(color="tab:cyan", marker="x"),
              "nccl_symmetric": dict(color="tab:olive", marker="P"), "nccl_ce": dict(color="tab:pink", marker="*"),
              "floor": dict(color="black", linestyle="--", marker=".")}
    backends = [b for b in ("odc", "odc_staged", "odc_staged_push", "odc_registered", "odc_nvshmem", ref, "nccl_registered",
                            "nccl_symmetric", "nccl_ce", "floor") if any(r["backend"] == b for r in rows)]
    all_sizes = sorted({r["size_bytes"] for r in rows})
    for ax, op in zip(axes, OPS):
        for backend in backends:
            pts = sorted((r["size_bytes"], r["busbw_GBps"]) for r in rows
                         if r["op"] == op and r["backend"] == backend)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=backend,
                        **styles.get(backend, {}))
        ax.set_xscale("log", base=2)
        if all_sizes:
            ax.set_xticks(all_sizes)
            ax.set_xticklabels([size_label(s) for s in all_sizes], rotation=45, ha="right")
            ax.minorticks_off()
        ax.set_title(op.replace("_", "-") + (" (in-place)" if op == "all_gather" else " (SUM)"))
        ax.set_xlabel(f"size ({data.get('dtype', 'bf16')}, total)")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("busbw (GB/s)")
    gemm = (data.get("summary") or {}).get(f"gemm_slowdown_ratio_odc_vs_{ref}") or {}
    note = ""
    if gemm:
        note = "GEMM slowdown ratio odc/" + ref + ": " + ", ".join(
            f"{k} {v:.2f}" if isinstance(v, (int, float)) else f"{k} n/a" for k, v in gemm.items())
    count = data.get("gpu_count") or data.get("world_size", "?")
    ref_version = f", {ref} {data['nccl']}" if data.get("nccl") else ""
    fig.suptitle(f"odc vs {ref}: {data.get('device', '?')} x{count}, "
                 f"torch {data.get('torch', '?')}{ref_version}, "
                 f"{str(data.get('commit', '?'))[:10]}, {data.get('date', '?')[:10]}"
                 + (f"\n{note}" if note else ""), fontsize=10)
    fig.tight_layout()
    save_png(fig, png_path)
    plt.close(fig)
    return png_path
