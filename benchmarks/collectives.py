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
check costs, measurable where NCCL cannot run (ranks sharing one GPU).

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
"""
from __future__ import annotations

import os

# Keep NVLink multicast off (docs/configuration.md), before NCCL initialises.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch_odc_backend  # noqa: E402  (registers "odc"; imported before CUDA initialises)
from _meta import git_commit, lab_info, machine_kind  # noqa: E402
from _png import save_png  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_SIZES = [(1 << i) * MiB for i in range(10)]  # 1 MiB .. 512 MiB
CPU_DEFAULT_SIZES = [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB]
OPS = ("all_gather", "reduce_scatter")
REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT_DIR = REPO / "benchmarks" / "results"


# --------------------------------------------------------------------------- helpers
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


def _median(xs):
    return statistics.median(xs) if xs else None


def _pct(xs, q):
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


# --------------------------------------------------------------------------- odc's engine per size
SMS_SOURCE = ("reported by the backend for one call of each size, after the timed trials (the "
              "group's stats: fused_ops / fused_blocks, copy_engine_ops / copy_engine_blocks); "
              "sms = the most thread blocks the call held at once per rank (the fused kernel's grid; "
              "on the copy-engine path its reduction's grid plus one flag-kernel block per lane that "
              "ran one), an upper bound on SMs (one block per SM)")
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
              ref: dict(color="tab:blue", marker="s"), "floor": dict(color="black", linestyle="--", marker=".")}
    backends = [b for b in ("odc", "odc_nvshmem", ref, "floor") if any(r["backend"] == b for r in rows)]
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


# --------------------------------------------------------------------------- benchmark
class Bench:
    def __init__(self, args):
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.args = torch, dist, args
        # torch 2.13's names where they exist (the older ones warn there)
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self.cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        self.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        self.ref = args.reference.replace("-", "_") if args.reference else ("nccl" if self.cuda else "gloo")
        use_odc = "odc" in self.backends
        timeout = datetime.timedelta(seconds=args.pg_timeout)
        if self.cuda:
            # ranks share the GPUs where there are fewer (odc runs so; NCCL does not)
            self.local_rank = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
            default = "cpu:gloo,cuda:odc" if use_odc else "cpu:gloo,cuda:nccl"
        else:
            self.device = torch.device("cpu")
            default = "cpu:odc" if use_odc else "gloo"
        if use_odc:
            self.odc_mod = torch_odc_backend
        else:
            self.odc_mod = None
        dist.init_process_group(default, timeout=timeout)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.nvshmem = None
        if args.nvshmem_init or args.odc_nvshmem:  # before odc's first CUDA collective
            from torch_odc_backend import nvshmem as odc_nvshmem

            self.nvshmem = odc_nvshmem
            odc_nvshmem.init(slab_bytes=odc_nvshmem.default_slab_bytes(self.world)
                             if args.odc_nvshmem else None)
        if self.ref == "odc_nocheck":  # knobs are read when a group is created
            os.environ["ODC_MATCH_CHECK"] = "0"
            try:
                self.ref_pg = dist.new_group(backend="cpu:gloo,cuda:odc" if self.cuda else "cpu:odc",
                                             timeout=timeout)
            finally:
                os.environ.pop("ODC_MATCH_CHECK")
        else:
            self.ref_pg = dist.new_group(backend=self.ref, timeout=timeout)
        self.groups = {self.ref: self.ref_pg}
        if use_odc:
            self.groups["odc"] = dist.group.WORLD
        if use_odc and args.odc_nvshmem:
            # the transport knob is read when a group is created: this group's peers all go
            # through NVSHMEM, the default group's stay peer-to-peer
            before = os.environ.get("ODC_TRANSPORT")
            os.environ["ODC_TRANSPORT"] = "nvshmem"
            try:
                self.groups["odc_nvshmem"] = dist.new_group(backend="cpu:gloo,cuda:odc", timeout=timeout)
            finally:
                if before is None:
                    os.environ.pop("ODC_TRANSPORT")
                else:
                    os.environ["ODC_TRANSPORT"] = before
        if use_odc and args.registered:  # the odc group again, its buffers from allocate_tensor
            self.groups["odc_registered"] = dist.group.WORLD
        if args.registered and self.ref == "nccl":
            # NCCL's own registered memory beside plain NCCL: the NCCL group's allocate_tensor,
            # what FSDP2's set_allocate_memory_from_process_group_for_comm gives NCCL
            if self.ref_pg._get_backend(self.device).supports_tensor_alloc(self.device):
                self.groups["nccl_registered"] = self.ref_pg
            elif dist.get_rank() == 0:
                print("[collectives] this NCCL group cannot allocate registered memory: "
                      "nccl_registered is not measured", flush=True)
        self.order = [b for b in ("odc", "odc_registered", "odc_nvshmem", self.ref, "nccl_registered")
                      if b in self.groups]
        self.rows: list[dict] = []
        self.errors: list[str] = []
        self.dtype = torch.bfloat16
        self.started = time.time()
        commit, dirty = git_commit()
        if self.cuda:
            device_name = torch.cuda.get_device_name(self.device)
            try:
                v = torch.cuda.nccl.version()
                nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
            except Exception:  # noqa: BLE001
                nccl = None
        else:
            device_name, nccl = "cpu", None
        lab = lab_info(self.device, self.world) if self.cuda else None  # under benchmarks/lab.sh
        # The floor is local copies: the floor where ranks share a GPU (the lab) and on CPU; on
        # separate GPUs NVLink bounds the collectives instead (and the suite's time budget
        # counts), so there it runs only when asked for.
        shared = self.cuda and self.world > torch.cuda.device_count()
        self.floor = bool(args.floor) if args.floor is not None else (lab is not None or shared or not self.cuda)
        kind = args.kind or machine_kind(self.device if self.cuda else torch.device("cpu"), self.world)
        date = datetime.datetime.now(datetime.timezone.utc)
        self.meta = {
            "benchmark": "collectives",
            "kind": kind,
            "device": device_name,
            "gpu_count": self.world if self.cuda else 0,
            "world_size": self.world,
            "torch": torch.__version__,
            "nccl": nccl,
            "commit": commit,
            "commit_dirty": dirty,
            "date": date.isoformat(timespec="seconds"),
            "python": sys.version.split()[0],
            "reference_backend": self.ref,
            "package": os.path.dirname(torch_odc_backend.__file__),  # which build of odc ran
            "lab": lab,
            "floor": self.floor,
            "process_groups": {"odc": default if use_odc else None,
                               self.ref: ("odc group created under ODC_MATCH_CHECK=0" if self.ref == "odc_nocheck"
                                          else f"new_group(backend={self.ref!r})"),
                               **({"odc_nvshmem": "new_group(backend='cpu:gloo,cuda:odc') created under "
                                                  "ODC_TRANSPORT=nvshmem"} if "odc_nvshmem" in self.groups else {}),
                               **({"odc_registered": "the odc group, its buffers from its backend's "
                                                     "allocate_tensor (registered memory: zero-copy)"}
                                  if "odc_registered" in self.groups else {}),
                               **({"nccl_registered": "the NCCL group, its buffers from its backend's "
                                                      "allocate_tensor (NCCL's registered memory)"}
                                  if "nccl_registered" in self.groups else {})},
            "dtype": "bf16",
            "all_gather_inplace": True,
            "reduce_scatter_op": "SUM",
            "timing": ("CUDA events on the current stream" if self.cuda else "wall clock")
                      + "; per trial the slowest rank; median over trials",
            "env": {k: v for k, v in os.environ.items()
                    if k.startswith(("ODC_", "NCCL_", "TORCH_SYMM", "NVSHMEM_", "CUDA_VISIBLE",
                                  "CUDA_MPS_ACTIVE"))},
            "argv": sys.argv[1:],
        }
        out_dir = Path(args.out_dir)
        self.json_path = out_dir / f"collectives_{kind}_{date.strftime('%Y%m%d')}.json"
        if self.rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            self.log(f"{device_name} x{self.world}, torch {torch.__version__}, {self.ref} {nccl}, "
                     f"backends {self.order}, floor {'on' if self.floor else 'off'}, writing {self.json_path}")

    # ---------------------------------------------------------------- basics
    def others(self) -> list[str]:
        """The backends compared with the reference (odc, odc_nvshmem)."""
        return [b for b in self.order if b != self.ref]

    def log(self, msg: str):
        if self.rank == 0:
            print(f"[collectives {time.time() - self.started:7.1f}s] {msg}", flush=True)

    def host_barrier(self):
        """All ranks' devices idle and all ranks past this point (through the reference group)."""
        torch = self.torch
        if self.cuda:
            torch.cuda.synchronize()
            t = torch.ones(1, device=self.device)
            self.dist.all_reduce(t, group=self.ref_pg)
            torch.cuda.synchronize()
        else:
            self.dist.barrier(group=self.ref_pg)

    def reduce_floats(self, values: list[float], op: str) -> list[float]:
        """Element-wise MAX / MEAN / MIN of a list of floats across ranks (reference group)."""
        torch, dist = self.torch, self.dist
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if op == "mean":
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.ref_pg)
            t /= self.world
        else:
            dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN,
                            group=self.ref_pg)
        return t.cpu().tolist()

    def all_true(self, flag: bool) -> bool:
        return bool(self.reduce_floats([1.0 if flag else 0.0], "min")[0])

    def time_loop(self, fn, n_ops: int) -> float:
        """Microseconds per op for ``n_ops`` back-to-back calls of ``fn``.

        Also sets ``self.last_host_us``: the host's time per call to issue them (wall clock
        from before the first call to after the last, before any synchronisation; on CPU,
        where calls complete on the host, the same as the latency)."""
        torch = self.torch
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            h0 = time.perf_counter()
            for _ in range(n_ops):
                fn()
            self.last_host_us = (time.perf_counter() - h0) * 1e6 / n_ops
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e3 / n_ops
        t0 = time.perf_counter()
        for _ in range(n_ops):
            fn()
        self.last_host_us = (time.perf_counter() - t0) * 1e6 / n_ops
        return self.last_host_us

    def ops_per_trial(self, nbytes: int) -> int:
        if self.args.ops_per_trial:
            return self.args.ops_per_trial
        return 20 if nbytes <= 8 * MiB else 10 if nbytes <= 64 * MiB else 5

    # ---------------------------------------------------------------- collectives
    def buffer(self, backend, like):
        """``like`` itself, or for odc_registered / nccl_registered a copy of it in the group's
        registered memory (its backend's allocate_tensor, as FSDP2 allocates its buffers when
        asked to)."""
        if backend not in ("odc_registered", "nccl_registered"):
            return like
        b = self.groups[backend]._get_backend(self.device)
        t = b.allocate_tensor(like.numel(), dtype=like.dtype, device=self.device)
        return t.copy_(like)

    def engine_of(self, backend, fn) -> dict:
        """The engine and SMs of one call of ``fn`` on ``backend``'s group (its stats)."""
        from torch_odc_backend import backend_stats
        group = self.groups[backend]
        before = backend_stats(group, device="cuda")
        fn()
        return engine_from_stats(before, backend_stats(group, device="cuda"))

    def ag(self, backend, out, inp):
        self._gather(out, inp, group=self.groups[backend])

    def rs(self, backend, out, inp, op=None):
        self._scatter(out, inp, op=op if op is not None else self.dist.ReduceOp.SUM,
                      group=self.groups[backend])

    def _gen(self, seed: int):
        g = self.torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    def check(self, nbytes: int) -> dict:
        """Bitwise checks of odc against the reference backend and the expected tensors."""
        torch, dist, n, r = self.torch, self.dist, self.world, self.rank
        numel = nbytes // 2
        shard = numel // n
        res: dict = {"op": "check", "size_bytes": nbytes, "size": size_label(nbytes)}
        # All-gather, random bf16 bits (in-place: input is this rank's slot of the output).
        expected = torch.cat([torch.randn(shard, generator=self._gen(1000 + q), device=self.device,
                                          dtype=torch.float32).to(self.dtype) for q in range(n)])
        out = torch.empty(numel, dtype=self.dtype, device=self.device)
        got = {}
        for b in self.order:
            out.fill_(float("nan"))  # poison: stale data from another backend cannot pass
            out[r * shard:(r + 1) * shard].copy_(expected[r * shard:(r + 1) * shard])
            try:
                o = self.buffer(b, out)
                self.ag(b, o, o[r * shard:(r + 1) * shard])
                got[b] = o.clone()
                del o
            except Exception:  # noqa: BLE001
                res[f"ag_error_{b}"] = traceback.format_exc(limit=3)
        del out
        for b, t in got.items():
            res[f"ag_equal_expected_{b}"] = self.all_true(torch.equal(t, expected))
        for b in self.others():
            if b in got and self.ref in got:
                res[f"ag_equal_{b}_vs_{self.ref}"] = self.all_true(torch.equal(got[b], got[self.ref]))
        del got, expected
        # Reduce-scatter on small integers: exact in bf16 whatever the summation order.
        inputs = [torch.randint(-8, 9, (numel,), generator=self._gen(2000 + q), device=self.device,
                                dtype=torch.int8) for q in range(n)]
        exp_sum = sum(x[r * shard:(r + 1) * shard].float() for x in inputs)
        mine = inputs[r].to(self.dtype)
        del inputs
        ops = [("sum", dist.ReduceOp.SUM, exp_sum.to(self.dtype))]
        if n & (n - 1) == 0:  # division by a power of two is exact too
            ops.append(("avg", dist.ReduceOp.AVG, (exp_sum / n).to(self.dtype)))
        for name, op, exp in ops:
            got = {}
            for b in self.order:
                o = torch.full((shard,), float("nan"), dtype=self.dtype, device=self.device)
                try:
                    self.rs(b, o, self.buffer(b, mine), op)
                    got[b] = o
                except Exception:  # noqa: BLE001
                    res[f"rs_{name}_error_{b}"] = traceback.format_exc(limit=3)
            for b, t in got.items():
                res[f"rs_{name}_equal_expected_{b}"] = self.all_true(torch.equal(t, exp))
            for b in self.others():
                if b in got and self.ref in got:
                    res[f"rs_{name}_equal_{b}_vs_{self.ref}"] = self.all_true(torch.equal(got[b], got[self.ref]))
        if self.cuda:
            torch.cuda.synchronize()
        return res

    def floor_fns(self, op: str, nbytes: int, inp) -> dict:
        """The floor of ``op`` at ``nbytes``: each rank moves the least bytes the collective needs
        for it, on local buffers (no CUDA IPC; in the lab all ranks share one GPU's memory, so a
        local copy of the same bytes is the same memory traffic). name -> (fn, engine):

        * all_gather: copy (W-1)/W * S bytes (what the gather brings each rank), with the copy
          engine (``copy_``: cudaMemcpyAsync device to device, as odc's copies) and with an SM
          kernel (``torch.mul(src, 1, out=dst)``: an elementwise kernel, same bytes);
        * reduce_scatter: read the W chunks of S/W bytes of one shard and write their sum, with
          an SM kernel (``torch.sum`` over a (W, S/W) view of the input, fp32 accumulation);
          and copy engine + sum: the W-1 other chunks staged by cudaMemcpyAsync, then the same
          sum (a copy engine cannot add, so this one moves more bytes).
        """
        torch, n = self.torch, self.world
        if n < 2:
            return {}
        shard = nbytes // 2 // n
        kw = dict(dtype=self.dtype, device=self.device)
        # same-device cudaMemcpyAsync: the call odc's copy path makes (in the lab its peer
        # pointers are on the same device too), whichever unit the driver runs it on
        ce = "cudaMemcpyAsync D2D (copy_)" if self.cuda else "memcpy (copy_)"
        if op == "all_gather":
            src = torch.ones((n - 1) * shard, **kw)
            dst = torch.empty((n - 1) * shard, **kw)
            return {"floor_ce": (lambda: dst.copy_(src), ce),
                    "floor_sm": (lambda: torch.mul(src, 1, out=dst),
                                 "SM kernel (elementwise mul by 1)" if self.cuda else "elementwise mul by 1")}
        chunks = inp.view(n, shard)  # the input's W chunks: the bytes of one shard's sum
        red = torch.empty(shard, **kw)
        stage = torch.empty(n, shard, **kw)
        stage[n - 1].copy_(chunks[self.rank])  # this rank's own chunk needs no transfer
        others = inp[: (n - 1) * shard]  # as many bytes as the W-1 peers' chunks
        flat = stage.view(-1)[: (n - 1) * shard]

        def staged():
            flat.copy_(others)
            torch.sum(stage, dim=0, out=red)
        return {"floor_sm": (lambda: torch.sum(chunks, dim=0, out=red),
                             "SM kernel (torch.sum over the W chunks)" if self.cuda else "torch.sum over the W chunks"),
                "floor_ce": (staged, ce + " of the W-1 chunks, then torch.sum")}

    def measure(self, op: str, nbytes: int, skip: set) -> list[dict]:
        torch, n, r = self.torch, self.world, self.rank
        numel = nbytes // 2
        shard = numel // n
        if op == "all_gather":
            out = torch.randn(numel, device=self.device, dtype=torch.float32).to(self.dtype)
            inp = out[r * shard:(r + 1) * shard]
            outs = {b: self.buffer(b, out) for b in self.order}
            # Only the call is timed: the input views and the arguments are made here, once.
            fns = {b: functools.partial(self._gather, outs[b], outs[b][r * shard:(r + 1) * shard],
                                        group=self.groups[b]) for b in self.order}
        else:
            inp = torch.randn(numel, device=self.device, dtype=torch.float32).to(self.dtype)
            out = torch.empty(shard, device=self.device, dtype=self.dtype)
            inps = {b: self.buffer(b, inp) for b in self.order}
            fns = {b: functools.partial(self._scatter, out, inps[b], op=self.dist.ReduceOp.SUM,
                                        group=self.groups[b]) for b in self.order}
        backends = [b for b in self.order if b not in skip]
        floors = self.floor_fns(op, nbytes, inp) if self.floor else {}
        for name, (fn, _) in floors.items():  # timed like a backend, interleaved with them
            fns[name] = fn
            backends.append(name)
        k = self.ops_per_trial(nbytes)
        for b in backends:  # warm-up (connections, buffer registration, clocks)
            for _ in range(self.args.warmup):
                self.host_barrier()
                self.time_loop(fns[b], k)
        times = {b: [] for b in backends}
        host = {b: [] for b in backends}
        for i in range(self.args.trials):
            for b in (backends if i % 2 == 0 else backends[::-1]):
                self.host_barrier()
                times[b].append(self.time_loop(fns[b], k))
                host[b].append(self.last_host_us)
        engines = {}  # odc's engine for one more call, as the backend reports it (every rank calls)
        for b in backends:
            if self.cuda and b in ("odc", "odc_nocheck", "odc_registered"):
                engines[b] = self.engine_of(b, fns[b])
        rows = []
        for b in backends:
            per_trial = self.reduce_floats(times[b], "max")  # the slowest rank ends the collective
            host_us = _median(self.reduce_floats(host[b], "max"))
            lat = _median(per_trial)
            algbw = nbytes / (lat * 1e-6) / 1e9
            row = {
                "op": op, "backend": b, "size_bytes": nbytes, "size": size_label(nbytes),
                "dtype": "bf16", "world_size": n, "ops_per_trial": k, "trials": len(per_trial),
                "latency_us": lat, "latency_us_min": min(per_trial), "latency_us_p90": _pct(per_trial, 0.9),
                "algbw_GBps": algbw, "busbw_GBps": algbw * (n - 1) / n, "host_us": host_us,
            }
            if b in floors:
                row["engine"] = floors[b][1]
            elif self.cuda and b in engines:
                row.update({f"odc_{key}": v for key, v in engines[b].items()})
            rows.append(row)
        cands = [row for row in rows if row["backend"] in floors]
        if cands:  # the floor: the faster of the two engines (by median)
            best = min(cands, key=lambda row: row["latency_us"])
            rows.append({**best, "backend": "floor", "floor_engine": best["backend"],
                         "floor_bytes_moved_per_rank": (
                             {"read": (n - 1) * shard * 2, "write": (n - 1) * shard * 2} if op == "all_gather"
                             else {"read": n * shard * 2, "write": shard * 2})})
        return rows

    # ---------------------------------------------------------------- GEMM interference
    def gemm_interference(self, ag_bytes: int) -> list[dict]:
        torch, n, r = self.torch, self.world, self.rank
        a = self.args
        N = a.gemm_n
        x = torch.randn(N, N, device=self.device, dtype=self.dtype)
        y = torch.randn(N, N, device=self.device, dtype=self.dtype)
        z = torch.empty(N, N, device=self.device, dtype=self.dtype)
        numel = ag_bytes // 2
        shard = numel // n
        out = torch.randn(numel, device=self.device, dtype=torch.float32).to(self.dtype)
        inp = out[r * shard:(r + 1) * shard]
        side = torch.cuda.Stream(device=self.device)
        cur = torch.cuda.current_stream(self.device)
        G = a.gemm_iters

        def gemm_loop():
            for _ in range(G):
                torch.mm(x, y, out=z)

        def alone() -> tuple[float, None]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(cur)
            gemm_loop()
            end.record(cur)
            end.synchronize()
            return start.elapsed_time(end), None

        def concurrent(b: str, n_ag: int) -> tuple[float, float]:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            ev[0].record(cur)
            side.wait_stream(cur)  # both streams start together
            per = n_ag / G
            issued = 0
            for i in range(G):
                torch.mm(x, y, out=z)
                want = min(n_ag, math.ceil((i + 1) * per))
                with torch.cuda.stream(side):
                    while issued < want:
                        self.ag(b, out, inp)
                        issued += 1
            ev[1].record(cur)
            with torch.cuda.stream(side):
                while issued < n_ag:
                    self.ag(b, out, inp)
                    issued += 1
                ev[2].record(side)
            cur.wait_stream(side)
            torch.cuda.synchronize()
            return ev[0].elapsed_time(ev[1]), ev[0].elapsed_time(ev[2])

        # warm-up and calibration
        for _ in range(2):
            self.host_barrier()
            alone()
        t_alone_est = self.reduce_floats([_median([alone()[0] for _ in range(3)])], "max")[0]
        n_ag = {}
        for b in self.order:
            self.host_barrier()
            self.time_loop(lambda: self.ag(b, out, inp), 3)
            self.host_barrier()
            t_ag_ms = self.reduce_floats([self.time_loop(lambda: self.ag(b, out, inp), 5) / 1e3], "max")[0]
            # Enough all-gathers to outlast the GEMM loop even when slowed down by it.
            n_ag[b] = max(2, min(a.gemm_max_ag, math.ceil(a.gemm_ag_cover * t_alone_est / t_ag_ms) + 1))
            self.host_barrier()
            concurrent(b, n_ag[b])  # warm-up of the concurrent pattern
        configs = ["alone"] + list(self.order)
        gemm_ms = {c: [] for c in configs}
        span_ms = {b: [] for b in self.order}
        for t in range(a.gemm_trials):
            rot = t % len(configs)
            for c in configs[rot:] + configs[:rot]:
                self.host_barrier()
                if c == "alone":
                    g, _ = alone()
                else:
                    g, s = concurrent(c, n_ag[c])
                    span_ms[c].append(s)
                gemm_ms[c].append(g)
        med = {}
        for c in configs:
            per_trial = self.reduce_floats(gemm_ms[c], "mean")  # a local effect: mean over ranks
            med[c] = _median(per_trial)
        rows = []
        tflops = 2 * N ** 3 * G / (med["alone"] * 1e-3) / 1e12
        rows.append({"op": "gemm", "backend": "alone", "ag_size_bytes": ag_bytes,
                     "ag_size": size_label(ag_bytes), "gemm_n": N, "gemm_iters": G,
                     "gemm_ms": med["alone"], "gemm_ms_per_iter": med["alone"] / G,
                     "gemm_tflops": tflops, "slowdown": 0.0, "trials": a.gemm_trials})
        for b in self.order:
            spans = self.reduce_floats(span_ms[b], "max")
            covered = self.all_true(all(s >= g for s, g in zip(span_ms[b], gemm_ms[b])))
            span = _median(spans)
            ag_ms = span / n_ag[b]
            rows.append({
                "op": "gemm", "backend": b, "ag_size_bytes": ag_bytes, "ag_size": size_label(ag_bytes),
                "gemm_n": N, "gemm_iters": G, "gemm_ms": med[b], "gemm_ms_per_iter": med[b] / G,
                "slowdown": med[b] / med["alone"] - 1.0, "trials": a.gemm_trials,
                "ag_per_trial": n_ag[b], "ag_covered_gemm": covered,
                "ag_ms_concurrent": ag_ms,
                "ag_busbw_concurrent_GBps": ag_bytes / (ag_ms * 1e-3) / 1e9 * (n - 1) / n,
            })
        del x, y, z, out
        return rows

    # ---------------------------------------------------------------- summary / output
    def summary(self) -> dict:
        ref = self.ref
        by = {(r["op"], r["backend"], r["size_bytes"]): r for r in self.rows if r["op"] in OPS}
        s: dict = {}
        for b in self.others():  # keys of the odc group keep their names; others add theirs
            ratio: dict = {}
            lat1: dict = {}
            min4: dict = {}
            for op in OPS:
                sizes = sorted({k[2] for k in by if k[0] == op})
                ratio[op] = {}
                for sz in sizes:
                    o, c = by.get((op, b, sz)), by.get((op, ref, sz))
                    if o and c and c["busbw_GBps"]:
                        ratio[op][size_label(sz)] = o["busbw_GBps"] / c["busbw_GBps"]
                big = [ratio[op][size_label(sz)] for sz in sizes
                       if sz >= 4 * MiB and size_label(sz) in ratio[op]]
                min4[op] = min(big) if big else None
                o, c = by.get((op, b, MiB)), by.get((op, ref, MiB))
                lat1[op] = o["latency_us"] / c["latency_us"] if o and c else None
            suffix = "" if b == "odc" else f"_{b}"
            s[f"busbw_ratio_{b}_vs_{ref}"] = ratio
            s[f"min_busbw_ratio_ge_4MiB{suffix}"] = min4
            s[f"latency_ratio_{b}_vs_{ref}_1MiB"] = lat1
        if any(k[1] == "nccl_registered" for k in by) and any(k[1] == "odc_registered" for k in by):
            s["busbw_ratio_odc_registered_vs_nccl_registered"] = {
                op: {size_label(sz): by[(op, "odc_registered", sz)]["busbw_GBps"] / by[(op, "nccl_registered", sz)]["busbw_GBps"]
                     for sz in sorted({k[2] for k in by if k[0] == op})
                     if (op, "odc_registered", sz) in by and (op, "nccl_registered", sz) in by}
                for op in OPS}
        # odc per size (latency, host us, engine / SMs, floor): the zero-copy path where it was
        # measured (odc_staged then holds the staged path's), else the staged one
        primary = "odc_registered" if any(k[1] == "odc_registered" for k in by) else "odc"
        s["odc_path"] = "registered (zero-copy)" if primary == "odc_registered" else "staged"
        if any(k[1] == primary for k in by):
            has_floor = any(k[1] == "floor" for k in by)
            keys = ["latency_us", "host_us"] + (["engine", "sms"] if self.cuda else []) + (
                ["floor_us", "floor_engine", "ratio_to_floor"] if has_floor else [])
            for key in keys:
                s[key] = {op: {} for op in OPS}
            for op in OPS:
                for sz in sorted({k[2] for k in by if k[0] == op}):
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
            if primary != "odc" and any(k[1] == "odc" for k in by):
                st = s["odc_staged"] = {"latency_us": {op: {} for op in OPS}, "host_us": {op: {} for op in OPS},
                                        "ratio_to_floor": {op: {} for op in OPS}}
                for (op, b, sz), o in by.items():
                    if b != "odc":
                        continue
                    f = by.get((op, "floor", sz))
                    st["latency_us"][op][size_label(sz)] = o["latency_us"]
                    st["host_us"][op][size_label(sz)] = o.get("host_us")
                    if f and f["latency_us"]:
                        st["ratio_to_floor"][op][size_label(sz)] = o["latency_us"] / f["latency_us"]
            if has_floor:
                s["floor_definition"] = FLOOR_DEFINITION
            if self.cuda:
                s["sms_source"] = SMS_SOURCE
            s["host_us_definition"] = HOST_US_DEFINITION
        s["peak_busbw_GBps"] = {op: {b: max((r["busbw_GBps"] for k, r in by.items() if k[0] == op and k[1] == b),
                                            default=None) for b in self.order} for op in OPS}
        gemm = [r for r in self.rows if r["op"] == "gemm"]
        if gemm:
            slow: dict = {}
            for g in gemm:
                if g["backend"] != "alone":
                    slow.setdefault(g["backend"], {})[g["ag_size"]] = g["slowdown"]
            s["gemm_slowdown"] = slow
            for b in self.others():
                gratio: dict = {}
                for label in slow.get(b, {}):
                    so, sc = slow[b][label], slow.get(ref, {}).get(label)
                    gratio[label] = so / sc if sc is not None and sc > 0 else None
                s[f"gemm_slowdown_ratio_{b}_vs_{ref}"] = gratio
        checks = [r for r in self.rows if r["op"] == "check"]
        flags = [v for r in checks for k, v in r.items() if "_equal_" in k]
        s["all_checks_passed"] = bool(flags) and all(flags) and not any(
            "_error_" in k for r in checks for k in r)
        s["errors"] = len(self.errors)
        return s

    def write(self, final: bool = False):
        if self.rank != 0:
            return
        doc = dict(self.meta)
        doc["complete"] = final
        doc["elapsed_s"] = round(time.time() - self.started, 1)
        doc["rows"] = self.rows
        doc["errors"] = self.errors
        doc["summary"] = self.summary()
        if self.odc_mod is not None and hasattr(self.odc_mod, "backend_stats"):
            for call in (lambda: self.odc_mod.backend_stats(None, self.device.type),
                         lambda: self.odc_mod.backend_stats()):
                try:  # counters are optional; never let them break the results file
                    doc["odc_backend_stats"] = json.loads(json.dumps(call(), default=str))
                    break
                except Exception:  # noqa: BLE001
                    pass
        if self.nvshmem is not None:  # slab use and routed get / put / signal counts
            doc["nvshmem_status"] = self.nvshmem.status()
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(self.json_path)

    def print_table(self):
        if self.rank != 0:
            return
        ref, others = self.ref, self.others()
        by = {(r["op"], r["backend"], r["size_bytes"]): r for r in self.rows if r["op"] in OPS}

        def f(row, key, w, p):
            return f"{row[key]:{w}.{p}f}" if row else " " * (w - 3) + "n/a"
        w = max(11, *(len(b) + 6 for b in self.order))
        print(f"\n{'op':<15}{'size':>8} | " + " ".join(f"{b + ' us':>{w}}" for b in self.order) + " | "
              + " ".join(f"{b + ' busbw':>{w}}" for b in self.order) + " | "
              + " ".join(f"{b + '/' + ref:>{w}}" for b in others))
        for op in OPS:
            for sz in sorted({k[2] for k in by if k[0] == op}):
                rows = {b: by.get((op, b, sz)) for b in self.order}
                c = rows[ref]
                ratios = " ".join(f"{rows[b]['busbw_GBps'] / c['busbw_GBps']:{w}.2f}" if rows[b] and c
                                  else " " * (w - 3) + "n/a" for b in others)
                print(f"{op:<15}{size_label(sz):>8} | " + " ".join(f(rows[b], "latency_us", w, 1) for b in self.order)
                      + " | " + " ".join(f(rows[b], "busbw_GBps", w, 1) for b in self.order) + " | " + ratios)
        if any(k[1] == "floor" for k in by):
            print(f"\n{'op':<15}{'size':>8} | {'odc us':>9} {'floor us':>9} {'floor by':>9} {'odc/floor':>9} | "
                  f"{'host us':>8} | odc engine (SMs, derived)")
            for op in OPS:
                for sz in sorted({k[2] for k in by if k[0] == op}):
                    o, fl = by.get((op, "odc", sz)), by.get((op, "floor", sz))
                    ratio = f"{o['latency_us'] / fl['latency_us']:9.2f}" if o and fl else f"{'n/a':>9}"
                    eng = f"{o['odc_engine']} ({o['odc_sms']})" if o and "odc_engine" in o else "-"
                    print(f"{op:<15}{size_label(sz):>8} | {f(o, 'latency_us', 9, 1)} {f(fl, 'latency_us', 9, 1)} "
                          f"{(fl['floor_engine'] if fl else 'n/a'):>9} {ratio} | {f(o, 'host_us', 8, 1)} | {eng}")
        for g in (r for r in self.rows if r["op"] == "gemm"):
            print(f"gemm {g['gemm_n']} with {g['ag_size']} all-gather [{g['backend']:>5}]: "
                  f"{g['gemm_ms_per_iter']:.3f} ms/iter, slowdown {100 * g['slowdown']:6.2f}%"
                  + (f", ag covered gemm: {g['ag_covered_gemm']}" if "ag_covered_gemm" in g else ""))
        s = self.summary()
        print("summary:", json.dumps(s, indent=1, default=str), flush=True)

    # ---------------------------------------------------------------- main
    def run(self):
        a, n = self.args, self.world
        sizes = a.sizes or (DEFAULT_SIZES if self.cuda else CPU_DEFAULT_SIZES)
        for raw in sizes:
            elems = max(n, raw // 2 // n * n)  # whole bf16 elements, equal shards
            nbytes = elems * 2
            skip: set = set()
            if not a.no_check:
                res = self.check(nbytes)
                self.rows.append(res)
                bad = [k for k, v in res.items() if "_equal_" in k and v is False]
                for b in self.others():  # a backend whose check raised is not timed
                    if f"ag_error_{b}" in res or f"rs_sum_error_{b}" in res:
                        skip.add(b)
                if bad or any("_error_" in k for k in res):
                    self.errors.append(f"{size_label(nbytes)}: check failed: {bad} "
                                       f"{[k for k in res if '_error_' in k]}")
                    self.log(f"CHECK FAILED at {size_label(nbytes)}: {bad} "
                             f"{ {k: v for k, v in res.items() if '_error_' in k} }")
            for op in a.ops:
                try:
                    rows = self.measure(op, nbytes, skip)
                except Exception:  # noqa: BLE001
                    self.errors.append(f"{op} {size_label(nbytes)}: {traceback.format_exc(limit=4)}")
                    self.log(f"ERROR in {op} {size_label(nbytes)}:\n{self.errors[-1]}")
                    rows = []
                self.rows.extend(rows)
                msg = "  ".join(f"{r['backend']} {r['latency_us']:9.1f} us {r['busbw_GBps']:7.1f} GB/s"
                                for r in rows)
                self.log(f"{op:<15}{size_label(nbytes):>8}: {msg}")
            self.write()
        if self.cuda and not a.no_gemm:
            for ag_raw in a.gemm_ag_sizes:
                ag_bytes = max(n, ag_raw // 2 // n * n) * 2
                try:
                    rows = self.gemm_interference(ag_bytes)
                except Exception:  # noqa: BLE001
                    self.errors.append(f"gemm {size_label(ag_bytes)}: {traceback.format_exc(limit=4)}")
                    self.log(f"ERROR in gemm {size_label(ag_bytes)}:\n{self.errors[-1]}")
                    rows = []
                self.rows.extend(rows)
                for g in rows:
                    self.log(f"gemm with {g['ag_size']} AG [{g['backend']:>5}]: {g['gemm_ms']:.2f} ms, "
                             f"slowdown {100 * g['slowdown']:.2f}%")
                self.write()
        self.write(final=True)
        self.print_table()
        if self.rank == 0:
            png = plot_results(self.json_path)
            self.log(f"wrote {self.json_path}" + (f" and {png}" if png else ""))
        ok = not self.errors
        self.host_barrier()
        self.dist.destroy_process_group()
        return ok


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="odc vs NCCL all-gather / reduce-scatter benchmark",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--plot", metavar="FILE.json", help="only redraw the PNG of an existing result file")
    p.add_argument("--kind", default=None, help="machine kind for the file name (default: <gpu-name>-x<world>)")
    p.add_argument("--out-dir", default=str(DEFAULT_OUT_DIR))
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
    bench = Bench(args)
    return 0 if bench.run() else 1


if __name__ == "__main__":
    sys.exit(main())
