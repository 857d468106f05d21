"""The collectives benchmark's process groups, its result metadata and the primitives every
measurement times with (barrier, cross-rank reduction of timings, the timed loop)."""
from __future__ import annotations

import datetime
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch_odc_backend  # registers "odc"; imported before CUDA initialises
from _meta import git_commit, lab_info, machine_kind
from collectives_nccl import NCCL_WINDOWED, Window, nccl_best_groups, nccl_row_fields
from collectives_util import MiB, with_env

@dataclass
class BenchContext:
    """What every measurement needs: the run's options, its device and groups, its results."""
    args: Any
    torch: Any
    dist: Any
    cuda: bool
    device: Any
    rank: int
    world: int
    ref: str  # the reference backend's name (nccl, gloo, odc_nocheck)
    ref_pg: Any
    groups: dict  # backend name -> process group
    order: list  # the backends measured, in this order
    gather: Callable  # all_gather_single where torch has it, else all_gather_into_tensor
    scatter: Callable
    odc_mod: Any  # torch_odc_backend where odc runs, else None
    nvshmem: Any  # torch_odc_backend.nvshmem where it was initialised, else None
    started: float
    dtype: Any
    floor: bool = False
    meta: dict = field(default_factory=dict)
    json_path: Path | None = None
    rows: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    windows: dict = field(default_factory=dict)  # backend -> its Window (nccl_symmetric, nccl_ce)
    notes: dict = field(default_factory=dict)  # backend -> how its group was made, where set up here
    nccl_rows: dict = field(default_factory=dict)  # NCCL backend -> what its rows record about NCCL

    def others(self) -> list[str]:
        """The backends compared with the reference (odc, odc_nvshmem)."""
        return [b for b in self.order if b != self.ref]

    def log(self, msg: str):
        if self.rank == 0:
            print(f"[collectives {time.time() - self.started:7.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------- groups
def create_context(args) -> BenchContext:
    """Initialise the default group and the compared ones; describe the run (rank 0 logs it)."""
    import torch
    import torch.distributed as dist

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    ref = args.reference.replace("-", "_") if args.reference else ("nccl" if cuda else "gloo")
    use_odc = "odc" in backends
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    if getattr(args, "nccl_debug_log", False):
        # NCCL reads these once, when its first communicator initialises: before any group
        os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,ENV,TUNING")
    device, default_pg = _device_and_default_backend(torch, cuda, use_odc)
    dist.init_process_group(default_pg, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    nvshmem = _init_nvshmem(args, world)
    ref_pg = _reference_group(dist, ref, cuda, timeout)
    groups = _compared_groups(dist, args, ref, ref_pg, use_odc, device, timeout)
    windows: dict = {}
    notes: dict = {}
    best = [n for n, flag in (("nccl_symmetric", "nccl_best"), ("nccl_ce", "nccl_ce")) if getattr(args, flag, False)]
    if best:
        groups.update(nccl_best_groups(torch, dist, args, ref, device, timeout, windows, notes, best))
    order = [b for b in ("odc", "odc_staged", "odc_staged_push", "odc_registered", "odc_nvshmem", ref, "nccl_registered",
                         *NCCL_WINDOWED) if b in groups]
    ctx = BenchContext(
        args=args, torch=torch, dist=dist, cuda=cuda, device=device, rank=rank, world=world,
        ref=ref, ref_pg=ref_pg, groups=groups, order=order,
        # torch 2.13's names where they exist (the older ones warn there)
        gather=getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor,
        scatter=getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor,
        odc_mod=torch_odc_backend if use_odc else None, nvshmem=nvshmem,
        started=time.time(), dtype=torch.bfloat16, windows=windows, notes=notes)
    ctx.nccl_rows = nccl_row_fields(ctx)
    _describe_run(ctx, default_pg if use_odc else None)
    return ctx


def _device_and_default_backend(torch, cuda: bool, use_odc: bool):
    if cuda:
        # ranks share the GPUs where there are fewer (odc runs so; NCCL does not)
        local_rank = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), ("cpu:gloo,cuda:odc" if use_odc else "cpu:gloo,cuda:nccl")
    return torch.device("cpu"), ("cpu:odc" if use_odc else "gloo")


def _init_nvshmem(args, world: int):
    """torch_odc_backend.nvshmem, initialised (before odc's first CUDA collective), if asked for."""
    if not (args.nvshmem_init or args.odc_nvshmem):
        return None
    from torch_odc_backend import nvshmem as odc_nvshmem

    odc_nvshmem.init(slab_bytes=odc_nvshmem.default_slab_bytes(world) if args.odc_nvshmem else None)
    return odc_nvshmem


def _reference_group(dist, ref: str, cuda: bool, timeout):
    if ref == "odc_nocheck":  # an odc group without the cross-rank descriptor check
        os.environ["ODC_MATCH_CHECK"] = "0"  # knobs are read when a group is created
        try:
            return dist.new_group(backend="cpu:gloo,cuda:odc" if cuda else "cpu:odc", timeout=timeout)
        finally:
            os.environ.pop("ODC_MATCH_CHECK")
    return dist.new_group(backend=ref, timeout=timeout)


def _compared_groups(dist, args, ref: str, ref_pg, use_odc: bool, device, timeout) -> dict:
    groups = {ref: ref_pg}
    odc_backend = "cpu:gloo,cuda:odc" if device.type == "cuda" else "cpu:odc"

    def odc_group_under(knob: str, value: str):  # another odc group, made with one knob set
        return with_env(knob, value, lambda: dist.new_group(backend=odc_backend, timeout=timeout))

    if use_odc:
        groups["odc"] = dist.group.WORLD
    if use_odc and args.odc_nvshmem:
        # this group's peers all go through NVSHMEM, the default group's stay peer-to-peer
        groups["odc_nvshmem"] = odc_group_under("ODC_TRANSPORT", "nvshmem")
    if use_odc and args.staged:  # every tensor staged through the rings (no zero-copy)
        groups["odc_staged"] = odc_group_under("ODC_ZERO_COPY", "0")
    if use_odc and args.staged_push:  # staged all-gathers pushed into the peers' landing rings
        groups["odc_staged_push"] = odc_group_under("ODC_STAGED_AG_PUSH", "1")
    if use_odc and args.registered:  # the odc group again, its buffers from allocate_tensor
        groups["odc_registered"] = dist.group.WORLD
    if args.registered and ref == "nccl":
        # NCCL's own registered memory beside plain NCCL: the NCCL group's allocate_tensor,
        # what FSDP2's set_allocate_memory_from_process_group_for_comm gives NCCL
        if ref_pg._get_backend(device).supports_tensor_alloc(device):
            groups["nccl_registered"] = ref_pg
        elif dist.get_rank() == 0:
            print("[collectives] this NCCL group cannot allocate registered memory: "
                  "nccl_registered is not measured", flush=True)
    return groups


# --------------------------------------------------------------------------- metadata
def _device_name_and_nccl(ctx: BenchContext):
    torch = ctx.torch
    if not ctx.cuda:
        return "cpu", None
    device_name = torch.cuda.get_device_name(ctx.device)
    try:
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001
        nccl = None
    return device_name, nccl


def _process_group_notes(ctx: BenchContext, odc_default_pg: str | None) -> dict:
    """How each measured backend's group was made (the result's "process_groups")."""
    ref = ctx.ref
    notes = {"odc": odc_default_pg,
             ref: ("odc group created under ODC_MATCH_CHECK=0" if ref == "odc_nocheck"
                   else f"new_group(backend={ref!r})")}
    if "odc_nvshmem" in ctx.groups:
        notes["odc_nvshmem"] = "new_group(backend='cpu:gloo,cuda:odc') created under ODC_TRANSPORT=nvshmem"
    if "odc_staged" in ctx.groups:
        notes["odc_staged"] = "new_group(backend=odc) created under ODC_ZERO_COPY=0"
    if "odc_staged_push" in ctx.groups:
        notes["odc_staged_push"] = "new_group(backend=odc) created under ODC_STAGED_AG_PUSH=1"
    if "odc_registered" in ctx.groups:
        notes["odc_registered"] = ("the odc group, its buffers from its backend's "
                                   "allocate_tensor (registered memory: zero-copy)")
    if "nccl_registered" in ctx.groups:
        notes["nccl_registered"] = ("the NCCL group, its buffers from its backend's "
                                    "allocate_tensor (NCCL's registered memory)")
    notes.update(ctx.notes)  # nccl_symmetric, nccl_ce
    return notes


def _describe_run(ctx: BenchContext, odc_default_pg: str | None):
    """Sets ctx.floor, ctx.meta (the result's header) and ctx.json_path; rank 0 makes the folder."""
    torch, args = ctx.torch, ctx.args
    commit, dirty = git_commit()
    device_name, nccl = _device_name_and_nccl(ctx)
    lab = lab_info(ctx.device, ctx.world) if ctx.cuda else None  # under benchmarks/lab.sh
    # The floor is local copies: the floor where ranks share a GPU (the lab) and on CPU; on
    # separate GPUs NVLink bounds the collectives instead (and the suite's time budget
    # counts), so there it runs only when asked for.
    shared = ctx.cuda and ctx.world > torch.cuda.device_count()
    ctx.floor = bool(args.floor) if args.floor is not None else (lab is not None or shared or not ctx.cuda)
    kind = args.kind or machine_kind(ctx.device if ctx.cuda else torch.device("cpu"), ctx.world)
    date = datetime.datetime.now(datetime.timezone.utc)
    ctx.meta = {
        "benchmark": "collectives", "kind": kind, "device": device_name,
        "gpu_count": ctx.world if ctx.cuda else 0, "world_size": ctx.world,
        "torch": torch.__version__, "nccl": nccl, "commit": commit, "commit_dirty": dirty,
        "date": date.isoformat(timespec="seconds"), "python": sys.version.split()[0],
        "reference_backend": ctx.ref,
        "package": os.path.dirname(torch_odc_backend.__file__),  # which build of odc ran
        "lab": lab, "floor": ctx.floor,
        "process_groups": _process_group_notes(ctx, odc_default_pg),
        "dtype": "bf16", "all_gather_inplace": True, "reduce_scatter_op": "SUM",
        "timing": ("CUDA events on the current stream" if ctx.cuda else "wall clock")
                  + "; per trial the slowest rank; median over trials",
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("ODC_", "NCCL_", "TORCH_SYMM", "NVSHMEM_", "CUDA_VISIBLE",
                                 "CUDA_MPS_ACTIVE"))},
        "argv": sys.argv[1:],
    }
    out_dir = Path(args.out_dir)
    ctx.json_path = out_dir / f"collectives_{kind}_{date.strftime('%Y%m%d')}.json"
    if ctx.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        ctx.log(f"{device_name} x{ctx.world}, torch {torch.__version__}, {ctx.ref} {nccl}, "
                f"backends {ctx.order}, floor {'on' if ctx.floor else 'off'}, writing {ctx.json_path}")


# --------------------------------------------------------------------------- timing primitives
def host_barrier(ctx: BenchContext):
    """All ranks' devices idle and all ranks past this point (through the reference group)."""
    torch = ctx.torch
    if ctx.cuda:
        torch.cuda.synchronize()
        t = torch.ones(1, device=ctx.device)
        ctx.dist.all_reduce(t, group=ctx.ref_pg)
        torch.cuda.synchronize()
    else:
        ctx.dist.barrier(group=ctx.ref_pg)


def reduce_floats(ctx: BenchContext, values: list[float], op: str) -> list[float]:
    """Element-wise MAX / MEAN / MIN of a list of floats across ranks (reference group)."""
    torch, dist = ctx.torch, ctx.dist
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    if op == "mean":
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=ctx.ref_pg)
        t /= ctx.world
    else:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN,
                        group=ctx.ref_pg)
    return t.cpu().tolist()


def all_true(ctx: BenchContext, flag: bool) -> bool:
    return bool(reduce_floats(ctx, [1.0 if flag else 0.0], "min")[0])


def time_loop(ctx: BenchContext, fn, n_ops: int) -> tuple[float, float]:
    """(latency, host) microseconds per op for ``n_ops`` back-to-back calls of ``fn``.

    host: the host's time per call to issue them (wall clock from before the first call to
    after the last, before any synchronisation; on CPU, where calls complete on the host, the
    same as the latency)."""
    torch = ctx.torch
    if ctx.cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        h0 = time.perf_counter()
        for _ in range(n_ops):
            fn()
        host_us = (time.perf_counter() - h0) * 1e6 / n_ops
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / n_ops, host_us
    t0 = time.perf_counter()
    for _ in range(n_ops):
        fn()
    host_us = (time.perf_counter() - t0) * 1e6 / n_ops
    return host_us, host_us


def ops_per_trial(args, nbytes: int) -> int:
    if args.ops_per_trial:
        return args.ops_per_trial
    return 20 if nbytes <= 8 * MiB else 10 if nbytes <= 64 * MiB else 5


# --------------------------------------------------------------------------- buffers and calls
def buffer(ctx: BenchContext, backend: str, like):
    """``like`` itself, or a copy of it in the group's registered memory: for odc_registered /
    nccl_registered its backend's allocate_tensor (as FSDP2 allocates its buffers when asked to),
    for nccl_symmetric / nccl_ce its window (slot 0)."""
    if backend in ctx.windows:
        return ctx.windows[backend].view(like.numel()).copy_(like)
    if backend not in ("odc_registered", "nccl_registered"):
        return like
    b = ctx.groups[backend]._get_backend(ctx.device)
    t = b.allocate_tensor(like.numel(), dtype=like.dtype, device=ctx.device)
    return t.copy_(like)


def output_buffer(ctx: BenchContext, backend: str, like):
    """A reduce-scatter's output: ``like`` itself, or for nccl_symmetric / nccl_ce a copy of it in
    its window's slot 1 (NCCL's symmetric paths need both ends in the window)."""
    if backend in ctx.windows:
        return ctx.windows[backend].view(like.numel(), slot=1).copy_(like)
    return like


def _in_window(w: Window, t) -> bool:
    start, size = w.flat.data_ptr(), w.flat.numel() * w.flat.element_size()
    return start <= t.data_ptr() < start + size


def all_gather(ctx: BenchContext, backend: str, out, inp):
    """In-place all-gather. For a windowed backend, tensors outside its window (the GEMM part's)
    are replaced by the same sizes in it: NCCL's symmetric paths need the window, and there
    the output is not read."""
    w = ctx.windows.get(backend)
    if w is not None and not _in_window(w, out):
        if out.numel() not in w.stand_ins:
            shard = out.numel() // ctx.world
            o = w.view(out.numel())
            w.stand_ins[out.numel()] = (o, o[ctx.rank * shard:(ctx.rank + 1) * shard])
        out, inp = w.stand_ins[out.numel()]
    ctx.gather(out, inp, group=ctx.groups[backend])


def reduce_scatter(ctx: BenchContext, backend: str, out, inp, op=None):
    ctx.scatter(out, inp, op=op if op is not None else ctx.dist.ReduceOp.SUM, group=ctx.groups[backend])
