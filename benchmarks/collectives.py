#!/usr/bin/env python3
"""All-gather / reduce-scatter: odc vs NCCL, side by side in one run.

Run under torchrun on N GPUs of one host:

    torchrun --standalone --nproc-per-node=4 benchmarks/collectives.py
    torchrun --standalone --nproc-per-node=2 benchmarks/collectives.py --sizes 1M,64M --no-gemm

Two process groups are used: the default one, "cpu:gloo,cuda:odc", and
``dist.new_group(backend="nccl")``. Trials of the backends are interleaved
(and their order alternated) so that clock or thermal drift hits all alike.
``--odc-nvshmem`` adds a third, "odc_nvshmem": an odc group created with
ODC_TRANSPORT=nvshmem, whose every peer goes through NVSHMEM's on-stream calls
(needs an ODC_WITH_NVSHMEM=1 build): odc over CUDA IPC, odc over NVSHMEM and
NCCL side by side in one run. ``--reference odc-nocheck`` compares odc with an odc group
that skips the cross-rank descriptor check (ODC_MATCH_CHECK=0) instead of NCCL: what the
check costs, measurable where NCCL cannot run (ranks sharing one GPU). ``--nccl-best`` adds
NCCL's symmetric kernels as a reference ("nccl_symmetric": an NCCL group whose buffers lie in a
symmetric window, a MemPool of the group's allocator registered with
register_mem_pool(pool, symm=True)), and ``--nccl-ce`` NCCL's copy-engine all-gather ("nccl_ce":
the same under the zero-CTA policy); each is skipped, with a line saying why, where torch or
NCCL lacks it.

Measured, in bf16, for each size (size = total output bytes of the all-gather
= total input bytes of the reduce-scatter; in-place all-gather as FSDP2 issues
it; reduce-scatter with SUM):
  * correctness once per size: odc's all-gather output equals NCCL's bitwise
    (and the expected tensor); reduce-scatter SUM/AVG on integer-valued data
    (exact in bf16) equals NCCL's and the expected result bitwise;
  * latency: median over ``--trials`` timed trials of a loop of a few ops each
    (CUDA events on the current stream; per trial the slowest rank counts),
    after warm-up; algbw = size / latency, busbw = algbw * (n - 1) / n, in GB/s
    (1e9 bytes);
  * GEMM slowdown: a bf16 8192x8192 GEMM loop on the default stream timed alone
    and while an all-gather (256 MiB and 64 MiB) runs continuously on another
    stream, per backend; slowdown = t_concurrent / t_alone - 1.

The floor (``--floor``; on by default in the lab and on CPU): per size, every rank at once moves the least bytes the
collective needs for it on local buffers, with the copy engine and with an SM kernel, timed like
the backends and interleaved with them; the faster is the floor, and the summary reports odc's
latency / floor, host us per call, and odc's engine and SMs per size (as the backend reports
them for one call: ``engine_from_stats``). In the one-GPU lab (``benchmarks/lab.sh``: W ranks on one GPU under a private MPS
daemon, ``ODC_LAB_MPS=1``) the kind is ``<gpu>-mps-x<W>``; docs/performance.md, "The one-GPU lab".

Rank 0 writes ``<out-dir>/collectives_<kind>_<yyyymmdd>.json`` (rewritten after
every size, so a run cut short still leaves its rows) and a PNG with the same
stem. ``--plot FILE.json`` redraws the PNG of an existing result file.

``--device cpu`` runs the same measurement on CPU tensors ("cpu:odc" vs gloo,
wall-clock timing, no GEMM part): a smoke test of this script, not a benchmark.

This file is the command line and the run's order; the pieces beside it:
collectives_setup.py (the groups, the result's metadata, the timing primitives),
collectives_measure.py (the check, the floor, latency / bandwidth), collectives_gemm.py (GEMM
interference), collectives_report.py (summary, JSON file, table, PNG), collectives_util.py
(sizes, statistics, engine_from_stats).
"""
from __future__ import annotations

import os

# Keep NVLink multicast off (docs/configuration.md), before NCCL initialises.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402

# The pieces live beside this file (collectives_setup imports torch_odc_backend, which registers
# "odc", before CUDA initialises); the names tests and other scripts use are re-exported here.
from collectives_gemm import gemm_interference  # noqa: E402
from collectives_measure import check, measure  # noqa: E402
from collectives_report import plot_results, print_table, summarize, write  # noqa: E402
from collectives_nccl import release_windows  # noqa: E402
from collectives_setup import BenchContext, create_context, host_barrier  # noqa: E402
from collectives_util import (CPU_DEFAULT_SIZES, DEFAULT_OUT_DIR, DEFAULT_SIZES, GiB, KiB, MiB,  # noqa: E402
                              OPS, REPO, engine_from_stats, parse_size, parse_sizes, size_label)

__all__ = ["main", "parse_args", "run", "create_context", "BenchContext", "check", "measure",
           "gemm_interference", "summarize", "write", "print_table", "plot_results", "parse_size",
           "parse_sizes", "size_label", "engine_from_stats", "OPS", "KiB", "MiB", "GiB", "REPO",
           "DEFAULT_SIZES", "CPU_DEFAULT_SIZES", "DEFAULT_OUT_DIR"]


# --------------------------------------------------------------------------- the run
def _check_size(ctx: BenchContext, nbytes: int) -> set:
    """The bitwise check at ``nbytes`` (a row); returns the backends not to time (their check raised)."""
    res = check(ctx, nbytes)
    ctx.rows.append(res)
    bad = [k for k, v in res.items() if "_equal_" in k and v is False]
    skip = {b for b in ctx.others() if f"ag_error_{b}" in res or f"rs_sum_error_{b}" in res}
    if bad or any("_error_" in k for k in res):
        ctx.errors.append(f"{size_label(nbytes)}: check failed: {bad} "
                          f"{[k for k in res if '_error_' in k]}")
        ctx.log(f"CHECK FAILED at {size_label(nbytes)}: {bad} "
                f"{ {k: v for k, v in res.items() if '_error_' in k} }")
    return skip


def _measure_size(ctx: BenchContext, nbytes: int, skip: set):
    """Each op's latency / bandwidth rows at ``nbytes``; an op that raises is an error, not the end."""
    for op in ctx.args.ops:
        try:
            rows = measure(ctx, op, nbytes, skip)
        except Exception:  # noqa: BLE001
            ctx.errors.append(f"{op} {size_label(nbytes)}: {traceback.format_exc(limit=4)}")
            ctx.log(f"ERROR in {op} {size_label(nbytes)}:\n{ctx.errors[-1]}")
            rows = []
        ctx.rows.extend(rows)
        msg = "  ".join(f"{r['backend']} {r['latency_us']:9.1f} us {r['busbw_GBps']:7.1f} GB/s"
                        for r in rows)
        ctx.log(f"{op:<15}{size_label(nbytes):>8}: {msg}")


def _measure_gemm(ctx: BenchContext):
    """The GEMM interference rows, per all-gather size (the file rewritten after each)."""
    n = ctx.world
    for ag_raw in ctx.args.gemm_ag_sizes:
        ag_bytes = max(n, ag_raw // 2 // n * n) * 2
        try:
            rows = gemm_interference(ctx, ag_bytes)
        except Exception:  # noqa: BLE001
            ctx.errors.append(f"gemm {size_label(ag_bytes)}: {traceback.format_exc(limit=4)}")
            ctx.log(f"ERROR in gemm {size_label(ag_bytes)}:\n{ctx.errors[-1]}")
            rows = []
        ctx.rows.extend(rows)
        for g in rows:
            ctx.log(f"gemm with {g['ag_size']} AG [{g['backend']:>5}]: {g['gemm_ms']:.2f} ms, "
                    f"slowdown {100 * g['slowdown']:.2f}%")
        write(ctx)


def run(ctx: BenchContext) -> bool:
    """Every size (check, then each op), then the GEMM part; True if nothing failed."""
    a, n = ctx.args, ctx.world
    for raw in a.sizes or (DEFAULT_SIZES if ctx.cuda else CPU_DEFAULT_SIZES):
        nbytes = max(n, raw // 2 // n * n) * 2  # whole bf16 elements, equal shards
        skip = set() if a.no_check else _check_size(ctx, nbytes)
        _measure_size(ctx, nbytes, skip)
        write(ctx)  # after every size, so a run cut short still leaves its rows
    if ctx.cuda and not a.no_gemm:
        _measure_gemm(ctx)
    write(ctx, final=True)
    print_table(ctx)
    if ctx.rank == 0:
        png = plot_results(ctx.json_path)
        ctx.log(f"wrote {ctx.json_path}" + (f" and {png}" if png else ""))
    ok = not ctx.errors
    host_barrier(ctx)
    release_windows(ctx)  # while their groups still exist
    ctx.dist.destroy_process_group()
    return ok


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="odc vs NCCL all-gather / reduce-scatter benchmark",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--plot", metavar="FILE.json", help="only redraw the PNG of an existing result file")
    p.add_argument("--kind", default=None, help="machine kind for the file name (default: <gpu-name>-x<world>)")
    p.add_argument("--out-dir", default=str(DEFAULT_OUT_DIR),
                   help="where the result JSON and PNG go (default: a folder under the system's "
                        "temporary folder; benchmarks/results replaces the committed headline files)")
    p.add_argument("--sizes", type=parse_sizes, default=None,
                   help="comma list, e.g. 1M,4M,64M (bare numbers are MiB); default 1MiB..512MiB")
    p.add_argument("--ops", type=lambda s: [o.strip() for o in s.split(",") if o.strip()],
                   default=list(OPS), help="all_gather,reduce_scatter")
    p.add_argument("--backends", default="odc,ref",
                   help="'odc,ref' (default) or 'ref' alone; the reference is always measured")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="untimed loops per backend per size")
    p.add_argument("--ops-per-trial", type=int, default=0, help="0 = by size (20 / 10 / 5)")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--floor", action=argparse.BooleanOptionalAction, default=None,
                   help="also time the floor per size (the least bytes each rank must move, on local "
                        "buffers, copy engine and SM kernel, the faster counts) and report odc time / "
                        "floor; default: on in the lab (ODC_LAB_MPS=1 or ranks sharing a GPU) and on CPU")
    p.add_argument("--no-gemm", action="store_true")
    p.add_argument("--gemm-n", type=int, default=8192)
    p.add_argument("--gemm-iters", type=int, default=20, help="GEMMs per timed loop")
    p.add_argument("--gemm-trials", type=int, default=10)
    p.add_argument("--gemm-ag-sizes", type=parse_sizes, default=[256 * MiB, 64 * MiB])
    p.add_argument("--gemm-ag-cover", type=float, default=1.6,
                   help="all-gathers issued per concurrent trial cover this multiple of the GEMM loop")
    p.add_argument("--gemm-max-ag", type=int, default=2000)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cpu: smoke test of this script on CPU tensors (cpu:odc vs gloo)")
    p.add_argument("--pg-timeout", type=float, default=300.0)
    p.add_argument("--reference", choices=("nccl", "gloo", "odc-nocheck"), default=None,
                   help="what odc is compared with (default: nccl on GPUs, gloo on CPU); odc-nocheck: "
                        "an odc group without the cross-rank descriptor check (ODC_MATCH_CHECK=0)")
    p.add_argument("--registered", action="store_true",
                   help="also measure odc with its buffers in registered memory (odc_registered: "
                        "allocate_tensor, zero-copy) and, against NCCL, NCCL with its own "
                        "(nccl_registered); the summary's per-size keys then describe odc_registered "
                        "and busbw_ratio_odc_registered_vs_nccl_registered compares the two")
    p.add_argument("--nccl-best", action="store_true",
                   help="against NCCL on CUDA, also measure nccl_symmetric where this torch and NCCL offer "
                        "it: a group whose buffers lie in a symmetric window (a MemPool of its "
                        "mem_allocator, register_mem_pool(pool, symm=True); NCCL >= 2.27's symmetric "
                        "kernels); the summary adds busbw_ratio_odc_vs_nccl_best (nccl_best: the highest "
                        "busbw of the NCCL variants measured, per op and size)")
    p.add_argument("--nccl-ce", action="store_true",
                   help="also measure nccl_ce: the same in a group under the zero-CTA policy (NCCL >= "
                        "2.28's copy-engine all-gather, ranks on one host). With torch 2.11 and NCCL 2.28.9 "
                        "on 4 x H200 its all-gather failed at its first call (NCCL: 'invalid argument' in "
                        "its copy-engine code), so it is not part of --nccl-best")
    p.add_argument("--nccl-debug-log", action="store_true",
                   help="NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,ENV,TUNING before any group is made: NCCL "
                        "logs its set-up and the algorithm / protocol it picks (per collective: long)")
    p.add_argument("--staged-push", action="store_true",
                   help="also measure an odc group whose staged all-gathers push into the peers' landing "
                        "rings (odc_staged_push: ODC_STAGED_AG_PUSH=1; busbw_ratio_odc_staged_push_vs_<ref>)")
    p.add_argument("--staged", action="store_true",
                   help="also measure an odc group that stages every tensor through its rings "
                        "(odc_staged: ODC_ZERO_COPY=0; busbw_ratio_odc_staged_vs_<ref>)")
    p.add_argument("--odc-nvshmem", action="store_true",
                   help="also measure an odc group whose peers all go through NVSHMEM (odc_nvshmem; "
                        "needs an ODC_WITH_NVSHMEM=1 build)")
    p.add_argument("--nvshmem-init", action="store_true",
                   help="call torch_odc_backend.nvshmem.init() first (for ODC_TRANSPORT=nvshmem or "
                        "ODC_HOST_SIZE splits; needs an ODC_WITH_NVSHMEM=1 build)")
    args = p.parse_args(argv)
    if args.odc_nvshmem and "odc" not in args.backends:
        p.error("--odc-nvshmem measures a second odc group: keep odc in --backends")
    bad = [o for o in args.ops if o not in OPS]
    if bad:
        p.error(f"unknown ops {bad}; choose from {OPS}")
    return args



def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot:
        png = plot_results(args.plot)
        print(png if png else "no PNG written")
        return 0 if png else 1
    warnings.filterwarnings("ignore", category=FutureWarning)  # *_tensor -> *_single renames (2.13)
    warnings.filterwarnings("ignore", message=".*barrier.*")
    return 0 if run(create_context(args)) else 1


if __name__ == "__main__":
    sys.exit(main())
