"""NCCL's best paths as the collectives benchmark's references (--nccl-best, --nccl-ce): NCCL
groups whose buffers lie in a symmetric window, each made only where this torch and NCCL offer
it (else rank 0 says why), and what their rows record."""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from collectives_util import DEFAULT_SIZES, MiB, with_env

if TYPE_CHECKING:
    from collectives_setup import BenchContext

NCCL_WINDOWED = ("nccl_symmetric", "nccl_ce")  # NCCL groups whose buffers lie in a symmetric window

class Unavailable(Exception):
    """A variant this torch, NCCL or launch cannot make; the message says why."""


@dataclass
class Window:
    """A group's symmetric window: one bf16 buffer from its own pool, laid out alike on every rank.
    Slot 0 (from element 0) holds an all-gather's output or a reduce-scatter's input, slot 1 (from
    ``split``) a reduce-scatter's output: NCCL's symmetric paths need both ends of a collective in
    a window, at the same offset on every rank."""
    pg: Any
    pool: Any
    flat: Any
    split: int
    cta_policy: str  # as the rows record it
    stand_ins: dict = field(default_factory=dict)  # numel -> (out, inp): see all_gather

    def view(self, numel: int, slot: int = 0):
        start = self.split if slot else 0
        return self.flat[start:start + numel]


def nccl_best_groups(torch, dist, args, ref: str, device, timeout, windows: dict, notes: dict,
                      names: list) -> dict:
    """nccl_symmetric and nccl_ce, each where this torch, NCCL and launch offer it (else rank 0
    says why); their windows go into ``windows``, how each was made into ``notes``."""
    groups = {}
    for name in names:
        try:
            _require_nccl_best(torch, dist, name, ref, device)
            pg, how, policy = _nccl_group(torch, dist, name, device, timeout)
            windows[name] = _window(torch, dist, pg, device, policy, *_window_numel(args, dist.get_world_size()))
        except Unavailable as e:
            if dist.get_rank() == 0:
                print(f"[collectives] {e}: {name} is not measured", flush=True)
            continue
        groups[name] = pg
        notes[name] = how
    return groups


def _nccl_version(torch) -> tuple | None:
    try:
        return tuple(torch.cuda.nccl.version()[:3])
    except Exception:  # noqa: BLE001
        return None


def _require_nccl_best(torch, dist, name: str, ref: str, device):
    """Raises Unavailable where ``name`` cannot run. Decided alike on every rank (the same torch,
    NCCL and launch): the group's creation and its window's registration are collective."""
    if device.type != "cuda" or ref != "nccl":
        raise Unavailable("NCCL's symmetric paths are compared on CUDA, against the NCCL reference")
    if getattr(dist, "ProcessGroupNCCL", None) is None or not hasattr(dist.ProcessGroupNCCL, "Options") \
            or not hasattr(torch.cuda, "MemPool") or not hasattr(torch.cuda, "use_mem_pool"):
        raise Unavailable("this torch has no ProcessGroupNCCL.Options or torch.cuda.MemPool / use_mem_pool")
    need = (2, 28) if name == "nccl_ce" else (2, 27)  # copy-engine collectives / symmetric kernels
    have = _nccl_version(torch)
    if have is None or have[:2] < need:
        raise Unavailable(f"NCCL {'.'.join(map(str, have)) if have else '(unknown)'} is older than "
                          f"{need[0]}.{need[1]}")
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if name == "nccl_ce" and local is not None and int(local) != dist.get_world_size():
        raise Unavailable("NCCL's copy-engine collectives need every rank on one host")


def _nccl_group(torch, dist, name: str, device, timeout):
    """(group, note, CTA policy): a new NCCL group whose communicator exists on return (the
    registration needs it); nccl_ce's under NCCL's zero-CTA policy, which its copy-engine
    collectives need: Options.config.cta_policy where this torch has it, else NCCL_CTA_POLICY=2
    while the communicator is made."""
    opts = dist.ProcessGroupNCCL.Options()
    zero = getattr(dist.ProcessGroupNCCL, "NCCL_CTA_POLICY_ZERO", None)
    env = None
    policy = os.environ.get("NCCL_CTA_POLICY", "default")
    how = "new_group(backend='nccl', pg_options=ProcessGroupNCCL.Options()"
    if name == "nccl_ce" and zero is not None and hasattr(opts.config, "cta_policy"):
        opts.config.cta_policy = zero
        policy, how = "zero (Options.config.cta_policy)", how + " with config.cta_policy = NCCL_CTA_POLICY_ZERO)"
    elif name == "nccl_ce":
        env = ("NCCL_CTA_POLICY", "2")
        policy, how = "zero (NCCL_CTA_POLICY=2)", how + ") created under NCCL_CTA_POLICY=2 (no config.cta_policy)"
    else:
        how += ")"

    def create():
        pg = _new_bound_group(dist, device, timeout, opts)
        # a first collective makes the communicator where new_group did not (then under env too)
        dist.all_reduce(torch.zeros(1, device=device), group=pg)
        torch.cuda.synchronize(device)
        return pg
    pg = with_env(*env, create) if env else create()
    return pg, how + ("; its buffers (the GEMM part's all-gathers' too) in its own symmetric window: a "
                      "MemPool of its mem_allocator, register_mem_pool(pool, symm=True)"), policy


def _new_bound_group(dist, device, timeout, opts):
    """Bound to the device where new_group can be (its communicator is made now), else made at
    its first collective."""
    bound = {"device_id": device} if "device_id" in inspect.signature(dist.new_group).parameters else {}
    return dist.new_group(backend="nccl", timeout=timeout, pg_options=opts, **bound)


def _window_numel(args, world: int) -> tuple[int, int]:
    """(split, total) elements: slot 0 fits the largest size this run measures (the GEMM part's
    all-gathers too), slot 1 (from a MiB boundary) that size's reduce-scatter shard."""
    raws = list(args.sizes or DEFAULT_SIZES) + ([] if args.no_gemm else list(args.gemm_ag_sizes))
    numel = max(max(world, raw // 2 // world * world) for raw in raws)
    align = MiB // 2
    split = -(-numel // align) * align
    return split, split + numel // world


def _all_ranks(torch, dist, flag: bool) -> bool:
    """``flag`` on every rank (through the default group's CPU backend)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _window(torch, dist, pg, device, policy: str, split: int, total: int) -> Window:
    """The group's window: ``total`` bf16 elements from a pool of its backend's allocator
    (ncclMemAlloc), allocated alike on every rank, then the pool registered as a symmetric window
    (ncclCommWindowRegister with NCCL_WIN_COLL_SYMMETRIC, collective, segment by segment in
    allocation order). Registered after the allocation, so it covers exactly this one segment."""
    be = pg._get_backend(device)
    try:
        pool = torch.cuda.MemPool(be.mem_allocator)
    except Exception as e:  # noqa: BLE001 -- alike on every rank: no such allocator here
        raise Unavailable(f"this NCCL group offers no allocator for a memory pool ({type(e).__name__}: {e})") from e
    flat, err = None, None
    try:
        with torch.cuda.use_mem_pool(pool):
            flat = torch.empty(total, dtype=torch.bfloat16, device=device)
    except RuntimeError as e:  # out of memory, maybe on some ranks only
        err = e
    if not _all_ranks(torch, dist, err is None):
        raise Unavailable(f"its window ({total * 2 / MiB:.0f} MiB) could not be allocated on every rank ({err})")
    register = getattr(be, "register_mem_pool", None)
    if register is None:
        raise Unavailable("this torch's NCCL group has no register_mem_pool")
    try:
        register(pool, symm=True)
    except TypeError as e:  # refused before any collective, alike on every rank
        raise Unavailable("this torch's register_mem_pool takes no symm argument (no symmetric windows)") from e
    except Exception as e:  # noqa: BLE001
        err = e
    if not _all_ranks(torch, dist, err is None):
        raise Unavailable(f"registering its window failed ({err})")
    return Window(pg=pg, pool=pool, flat=flat, split=split, cta_policy=policy)


def release_windows(ctx: BenchContext):
    """Deregisters the windows while their groups exist (every rank, in the same order), then
    frees them."""
    for w in ctx.windows.values():
        try:
            w.pg._get_backend(ctx.device).deregister_mem_pool(w.pool)
        except Exception:  # noqa: BLE001 -- the results are written; the process ends anyway
            pass
    ctx.windows.clear()


def nccl_row_fields(ctx: BenchContext) -> dict:
    """NCCL backend -> what its rows record: its buffers and CTA policy (NCCL reports no SMs)."""
    if not ctx.cuda or ctx.ref != "nccl":
        return {}
    buffers = {"nccl": "plain (the caching allocator)", "nccl_registered": "allocate_tensor (registered)",
               "nccl_symmetric": "symmetric window", "nccl_ce": "symmetric window"}
    policy = os.environ.get("NCCL_CTA_POLICY", "default")
    return {b: {"nccl_buffers": buffers[b],
                "nccl_cta_policy": ctx.windows[b].cta_policy if b in ctx.windows else policy,
                "nccl_sms": "not reported by NCCL"} for b in ctx.order if b in buffers}
