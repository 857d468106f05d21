"""Environment knobs. Every knob is an ``ODC_*`` variable, read once per group creation.

The README's "Environment knobs" table documents the same list.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def _bytes(name: str) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return 0
    m = re.fullmatch(r"(\d+)\s*([a-zA-Z]*)", raw)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{name}={raw!r}: expected a byte count such as 4096, 512K or 32M")
    value = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0 or value % 16:
        raise ValueError(f"{name}={raw!r}: must be a positive multiple of 16 bytes")
    return value


def _small_op_bytes() -> int:
    """ODC_SMALL_OP_BYTES: -1 when unset (the backend's default), 0 disables the fused path."""
    raw = os.environ.get("ODC_SMALL_OP_BYTES", "").strip()
    if raw == "0":
        return 0
    return _bytes("ODC_SMALL_OP_BYTES") if raw else -1


def _int(name: str, lo: int, hi: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer") from None
    if not lo <= value <= hi:
        raise ValueError(f"{name}={raw!r}: must be between {lo} and {hi}")
    return value


_TRANSPORTS = {"": 0, "auto": 0, "nvshmem": 1, "ipc": 2}


def _transport() -> int:
    raw = os.environ.get("ODC_TRANSPORT", "").strip().lower()
    if raw not in _TRANSPORTS:
        raise ValueError(f"ODC_TRANSPORT={raw!r}: expected auto, ipc or nvshmem")
    return _TRANSPORTS[raw]


def _host_size() -> int:
    """ODC_HOST_SIZE: global ranks per host (torchrun numbers ranks host by host: set it to
    the launcher's --nproc-per-node for multi-host runs); 0 / unset: every rank on one host.
    Not taken from LOCAL_WORLD_SIZE by itself: nested launches inherit that variable."""
    return _int("ODC_HOST_SIZE", 1, 1 << 20)


def _nvshmem_stage_always() -> bool:
    """ODC_NVSHMEM_STAGE: which routed copies stage their local side through the slab:
    auto (default) those to network peers (peers NVSHMEM cannot map), always every routed
    copy (the network path on one host, for tests)."""
    raw = os.environ.get("ODC_NVSHMEM_STAGE", "").strip().lower()
    if raw not in ("", "auto", "always"):
        raise ValueError(f"ODC_NVSHMEM_STAGE={raw!r}: expected auto or always")
    return raw == "always"


_SELF_SERVE = {"": 2, "auto": 2, "1": 1, "0": 0}


def _self_serve() -> int:
    """ODC_SELF_SERVE: who serves the collectives FSDP does not issue (all-reduce, broadcast,
    all-to-all, ...): auto (default) odc itself for CUDA tensors when ranks share a GPU (NCCL
    refuses that) or torch has no NCCL, else the inner gloo / NCCL backend; 1 odc always
    (CPU too); 0 the inner backend always."""
    raw = os.environ.get("ODC_SELF_SERVE", "").strip().lower()
    if raw not in _SELF_SERVE:
        raise ValueError(f"ODC_SELF_SERVE={raw!r}: expected auto, 1 or 0")
    return _SELF_SERVE[raw]


@dataclass(frozen=True)
class Knobs:
    """0 means "the backend's default for the device"."""

    chunk_bytes: int  # ODC_CHUNK_BYTES: bytes per ring slot (1 MiB CPU, 32 MiB CUDA)
    ring_slots: int  # ODC_RING_SLOTS: ring depth per channel (4)
    reduce_blocks: int  # ODC_REDUCE_BLOCKS: CUDA blocks of the owner-side reduction (16)
    accumulate_blocks: int  # ODC_ACCUMULATE_BLOCKS: CUDA blocks per peer of decoupled put-accumulate (16)
    small_op_bytes: int  # ODC_SMALL_OP_BYTES: largest copy of a fused one-kernel op (-1: default)
    stream_memops: bool  # ODC_STREAM_MEMOPS: CUDA waits/signals as stream memory operations (0)
    transport: int  # ODC_TRANSPORT: CUDA peers over 0 auto (NVSHMEM for other hosts), 1 NVSHMEM, 2 CUDA IPC
    host_size: int  # ODC_HOST_SIZE: global ranks per host; 0: every rank on one host
    match_check: bool  # ODC_MATCH_CHECK: ranks check that their collectives match (1)
    self_serve: int  # ODC_SELF_SERVE: other collectives by 0 the inner backend, 1 odc, 2 auto
    nvshmem_stage_always: bool = False  # ODC_NVSHMEM_STAGE=always: stage every routed copy


def knobs() -> Knobs:
    return Knobs(
        chunk_bytes=_bytes("ODC_CHUNK_BYTES"),
        ring_slots=_int("ODC_RING_SLOTS", 1, 1024),
        reduce_blocks=_int("ODC_REDUCE_BLOCKS", 1, 1024),
        accumulate_blocks=_int("ODC_ACCUMULATE_BLOCKS", 1, 1024),
        small_op_bytes=_small_op_bytes(),
        stream_memops=_int("ODC_STREAM_MEMOPS", 0, 1) == 1,
        transport=_transport(),
        host_size=_host_size(),
        match_check=os.environ.get("ODC_MATCH_CHECK", "").strip() == "" or _int("ODC_MATCH_CHECK", 0, 1) == 1,
        self_serve=_self_serve(),
        nvshmem_stage_always=_nvshmem_stage_always(),
    )
