"""The ODC_* environment: the one module of the package that reads it.

The backend's options come from one table, one entry per knob. Each entry names the
variable, its parser (which raises ``ValueError`` naming the variable), the
``OdcBackend.Options`` field it sets and what it does. An unset variable leaves the field at
the backend's default (``csrc/options.hpp``). Knobs are read once per group creation; a split
group inherits its parent's options instead. The process-wide knobs (not backend options)
have a function each, below, read when its caller needs the value (at import, as a group is
made, at exit). docs/configuration.md documents the same list (tests/test_config_docs.py
keeps them equal; tests/test_env_reads.py keeps the reads here).
"""
from __future__ import annotations

import os
import re
from typing import Any, Callable, NamedTuple

# The compiled core's types load on first use (the build check first, then _C): the package's
# import reads process-wide knobs here and must not load the core.
_CORE_TYPES = ("OdcBackend", "Options", "TransportKind", "SelfServe")


def _backend_class():
    from ._core import _C

    return _C.OdcBackend


def __getattr__(name: str):
    if name == "OdcBackend":
        return _backend_class()
    if name in _CORE_TYPES:
        return getattr(_backend_class(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def _bytes(name: str, raw: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([a-zA-Z]*)", raw)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{name}={raw!r}: expected a byte count such as 4096, 512K or 32M")
    value = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0 or value % 16:
        raise ValueError(f"{name}={raw!r}: must be a positive multiple of 16 bytes")
    return value


def _small_op_bytes(name: str, raw: str) -> int:
    return 0 if raw == "0" else _bytes(name, raw)  # 0 disables the fused path


def _int_in(lo: int, hi: int) -> Callable[[str, str], int]:
    def parse(name: str, raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            raise ValueError(f"{name}={raw!r}: expected an integer from {lo} to {hi}")
        return value

    return parse


def _flag(name: str, raw: str) -> bool:
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value not in (0, 1):
        raise ValueError(f"{name}={raw!r}: expected 0 or 1")
    return value == 1


def _choice(table: dict, expected: str) -> Callable[[str, str], Any]:
    def parse(name: str, raw: str):
        if raw.lower() not in table:
            raise ValueError(f"{name}={raw!r}: expected {expected}")
        return table[raw.lower()]

    return parse


def _enum_choice(enum: str, table: dict[str, str], expected: str) -> Callable[[str, str], Any]:
    """Like _choice, to members (by name) of the OdcBackend enum ``enum``, looked up at parse."""
    names = _choice(table, expected)

    def parse(name: str, raw: str):
        return getattr(getattr(_backend_class(), enum), names(name, raw))

    return parse


HOST_SIZE = "ODC_HOST_SIZE"  # also set by emulate_hosts, for the script it runs


class Knob(NamedTuple):
    env: str  # the variable
    parse: Callable[[str, str], Any]  # (name, stripped non-empty value) -> field value
    field: str  # the OdcBackend.Options field it sets
    doc: str


KNOBS: tuple[Knob, ...] = (
    Knob("ODC_CHUNK_BYTES", _bytes, "chunk_bytes", "bytes per ring slot (1 MiB CPU, 32 MiB CUDA)"),
    Knob("ODC_RING_SLOTS", _int_in(1, 1024), "ring_slots", "ring depth per channel (4)"),
    Knob("ODC_REDUCE_BLOCKS", _int_in(1, 1024), "reduce_blocks", "CUDA blocks of the owner-side reduction (16)"),
    Knob("ODC_ACCUMULATE_BLOCKS", _int_in(1, 1024), "accumulate_blocks",
         "CUDA blocks per peer of decoupled put-accumulate (16)"),
    Knob("ODC_SMALL_OP_BYTES", _small_op_bytes, "small_op_bytes",
         "largest copy or reduction output of a fused one-kernel CUDA op (8 MiB; 0: none)"),
    Knob("ODC_FUSED_BLOCKS", _int_in(1, 256), "fused_blocks", "most CUDA blocks of one fused op (32)"),
    Knob("ODC_STREAM_MEMOPS", _flag, "stream_memops", "CUDA waits/signals as stream memory operations (0)"),
    Knob("ODC_AG_PUSH", _choice({"auto": -1, "1": 1, "0": 0}, "auto, 1 or 0"), "ag_push",
         "zero-copy all-gathers write each rank's shard into its peers' outputs (1) or read the "
         "peers' shards (0); auto: push where every rank has a GPU of its own on one host"),
    Knob("ODC_STAGED_AG_PUSH", _flag, "staged_ag_push",
         "all-gathers on the staged path put each chunk into the peers' landing rings (1) instead "
         "of the peers getting it from this rank's ring (0)"),
    Knob("ODC_ZERO_COPY", _flag, "zero_copy",
         "all-gathers and reduce-scatters of CUDA tensors read each rank's input where it lies, "
         "wherever it was allocated, once the peers have its memory mapped (1); 0: staged through "
         "the rings"),
    Knob("ODC_TRANSPORT", _enum_choice("TransportKind", {"auto": "AUTO", "nvshmem": "NVSHMEM",
                                                         "ipc": "CUDA_IPC"}, "auto, ipc or nvshmem"),
         "transport", "CUDA peers over auto (other hosts: NVSHMEM where built, else the inner NCCL "
         "group), nvshmem (every peer) or ipc (CUDA IPC inside a host, NCCL across)"),
    # torchrun numbers ranks host by host: set it to the launcher's --nproc-per-node for
    # multi-host runs. Not taken from LOCAL_WORLD_SIZE by itself: nested launches inherit that.
    Knob(HOST_SIZE, _int_in(1, 1 << 20), "host_size",
         "global ranks per host (unset: hosts told apart by name only)"),
    Knob("ODC_MATCH_CHECK", _flag, "match_check", "ranks check that their collectives match (1)"),
    Knob("ODC_SELF_SERVE", _enum_choice("SelfServe", {"auto": "AUTO", "1": "ODC", "0": "INNER"},
                                        "auto, 1 or 0"),
         "self_serve", "the collectives FSDP does not issue: auto (odc for CUDA tensors when ranks "
         "share a GPU or torch has no NCCL, else the inner gloo / NCCL backend), 1 odc, 0 the inner backend"),
    Knob("ODC_POOL_BYTES", _bytes, "pool_bytes",
         "the most registered memory per rank behind allocate_tensor, for zero-copy collectives "
         "(64 MiB CPU, 8 GiB CUDA; grown as allocations need it)"),
    Knob("ODC_NVSHMEM_STAGE", _choice({"auto": False, "always": True}, "auto or always"),
         "nvshmem_stage_always", "which routed copies stage through the slab: auto those to network "
         "peers, always every routed copy (the network path on one host, for tests)"),
)


def options_from_env(timeout=None, group_name: str = "", global_ranks=(),
                     nccl_available: bool | None = None) -> OdcBackend.Options:
    """The options of a group made now: the ODC_* knobs (``ValueError`` naming a bad one),
    the group's timeout, name and global ranks (empty: the default group)."""
    options = _backend_class().Options
    opts = options() if timeout is None else options(timeout)
    for knob in KNOBS:
        raw = os.environ.get(knob.env, "").strip()
        if raw:
            setattr(opts, knob.field, knob.parse(knob.env, raw))
    opts.group_name = group_name
    opts.global_ranks_in_group = list(global_ranks)
    if nccl_available is None:
        import torch.distributed as dist

        nccl_available = dist.is_nccl_available()
    opts.nccl_available = nccl_available
    return opts


def knobs() -> OdcBackend.Options:
    """The ODC_* knobs as options (no group): validates them, and tells routing and ring sizes."""
    return options_from_env()


# ---- process-wide knobs (not backend options)

def allow_lazy_loading() -> bool:
    """ODC_ALLOW_LAZY_LOADING=1: keep CUDA's lazy module loading (odc otherwise asks for eager
    loading). Read at the package's import and as each odc group is made."""
    return os.environ.get("ODC_ALLOW_LAZY_LOADING") == "1"


def default_backend_as_set() -> str:
    """ODC_DEFAULT_BACKEND as set ("": unset), for the counters' record (ODC_STATS_DIR). It
    takes effect at ``import torch``: ``_torch_odc_backend_autoload``, a top-level module that
    must not import the package, parses it there."""
    return os.environ.get("ODC_DEFAULT_BACKEND", "")


def stats_dir() -> str:
    """ODC_STATS_DIR: the folder each process writes its odc groups' counters to at exit
    (``odc_stats_rank<R>.json``; "": unset, none written). Read as each odc group is made and
    again at exit."""
    return os.environ.get("ODC_STATS_DIR", "")


def host_size_as_set() -> str:
    """ODC_HOST_SIZE as set, unparsed ("": unset): emulate_hosts refuses to set another value
    over it. Groups parse it with the knobs above."""
    return os.environ.get(HOST_SIZE, "")


def fsdp_registered_devices() -> tuple[str, ...]:
    """ODC_FSDP_REGISTERED_MEMORY: on which devices every FSDP2 module whose collectives run on
    odc takes its all-gather and reduce-scatter buffers from registered memory (zero-copy), as
    ``use_registered_memory(model)`` does, with no call from the trainer: ``auto`` on GPUs,
    ``1`` on GPUs and CPUs, ``0`` (default) nowhere (left to the call). Read as each odc group
    is made."""
    raw = os.environ.get("ODC_FSDP_REGISTERED_MEMORY", "").strip() or "0"
    table = {"auto": ("cuda",), "1": ("cpu", "cuda"), "0": ()}
    return _choice(table, "auto, 1 or 0")("ODC_FSDP_REGISTERED_MEMORY", raw)


VERL_ROLES = ("actor", "critic", "reference")


def verl_roles() -> frozenset[str]:
    """ODC_VERL_ROLES: which of verl's FSDP engines the odc engine takes over
    (``torch_odc_backend.verl``): a comma-separated subset of actor, critic, reference;
    ``none`` for none (verl's own engine everywhere). Unset: actor and critic, the ones that
    train; the reference model's forward passes stay on verl's engine and NCCL."""
    raw = os.environ.get("ODC_VERL_ROLES", "").strip().lower()
    if not raw:
        return frozenset({"actor", "critic"})
    if raw == "none":
        return frozenset()
    roles = {r.strip() for r in raw.split(",") if r.strip()}
    bad = sorted(roles - set(VERL_ROLES))
    if bad or not roles:
        raise ValueError(f"ODC_VERL_ROLES={raw!r}: expected 'none' or a comma-separated subset of "
                         f"{', '.join(VERL_ROLES)} (unknown: {', '.join(bad) or 'empty'})")
    return frozenset(roles)


def verl_balance() -> str:
    """ODC_VERL_BALANCE: how the odc engine for verl spreads a minibatch's samples over the
    ranks (with verl's dynamic batch size): ``lb_mini`` (default; a plan made once from the
    samples' lengths) or ``dynamic`` (ranks claim microbatches as they become free; a 1-D mesh)."""
    raw = os.environ.get("ODC_VERL_BALANCE", "").strip().lower() or "lb_mini"
    if raw not in ("lb_mini", "dynamic"):
        raise ValueError(f"ODC_VERL_BALANCE={raw!r}: expected lb_mini or dynamic")
    return raw
