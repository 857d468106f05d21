"""NVSHMEM runtime of the NVSHMEM transport (peers on other hosts; tested on one host).

With ``ODC_TRANSPORT=nvshmem`` (every peer) or an ``ODC_HOST_SIZE`` split (peers on other
"hosts") set before ``init_process_group``, the default group's odc backend initialises
NVSHMEM itself (rank 0's unique id through the group's store) and allocates a slab of the
symmetric heap for two groups' windows; odc's CUDA windows and decoupled-mode arenas come
from that slab, and the routed peers are reached with NVSHMEM's on-stream get / put / signal
calls (the others peer-to-peer). ``odc.decouple`` grows the slab by its arena when needed.
``init(model=model)`` after fully_shard sizes it for the model's groups up front; ``init()``
also initialises NVSHMEM where the backend did not (other knobs, PyTorch's symmetric memory):

    import torch_odc_backend.nvshmem as odc_nvshmem
    odc_nvshmem.init(model=model)       # collective over the default group; optional
    odc_nvshmem.ring_selftest(1 << 20)  # put-with-signal to the next PE, checked

Network peers (routed peers NVSHMEM cannot map: GPUs of other hosts, or peers of this host
under a remote transport) need the local side of each get / put in memory NVSHMEM can use
remotely: copies whose local side is a user tensor go through staging rooms in this rank's
slab (``stage_bytes(world)`` per group, after its window; ``ODC_NVSHMEM_STAGE=always``
stages to every routed peer, to run that path on one host). Decoupled mode picks
``accumulate="local"`` by itself where a peer is routed (NVSHMEM has no float atomics).

Available when the extension was built with ``ODC_WITH_NVSHMEM=1`` (CUDA builds; NVSHMEM
from ``$NVSHMEM_HOME`` or the ``nvidia-nvshmem-cu13`` wheel). The NVSHMEM world is the
default process group and PE = global rank, the layout PyTorch's own NVSHMEM use assumes;
rank 0's unique id reaches the others through ``broadcast_object_list`` on the default
group. How to build, launch and what is tested: docs/multi_host.md.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import config
from ._core import _C

__all__ = ["available", "blocks_for", "default_slab_bytes", "ensure_room", "init", "ring_selftest",
           "routes_some_peer", "slab_bytes_for", "stage_bytes", "status"]

_UID_KEY = "odc_nvshmem_unique_id"


def available() -> bool:
    """Whether this build of the extension has the NVSHMEM runtime."""
    return bool(getattr(_C, "built_with_nvshmem", False))


def _require() -> None:
    if not available():
        raise RuntimeError("torch_odc_backend was built without NVSHMEM: rebuild a CUDA build with "
                           "ODC_WITH_NVSHMEM=1 (NVSHMEM from $NVSHMEM_HOME or the nvidia-nvshmem-cu13 "
                           "wheel)")


def _round4k(n: int) -> int:
    return (int(n) + 4095) // 4096 * 4096


_HEADROOM = 64 << 20  # slab bytes beyond the windows and arenas counted


def _window_bytes(world: int, options=None) -> int:
    """One group's communication window with these options' ring sizes (default: the ODC_*
    knobs'; about (world + 1) x ODC_RING_SLOTS x ODC_CHUNK_BYTES), plus its staging rooms
    where peers are routed."""
    k = options if options is not None else config.knobs()
    window = _C.window_bytes(world, k.chunk_bytes_for(cuda=True), k.ring_slots)
    if _routed(world, k) and available():
        window = _round4k(window) + stage_bytes(world)
    return window


def stage_bytes(world: int) -> int:
    """Bytes of a ``world``-rank group's staging rooms (one 2 MiB room per ring and lane)."""
    _require()
    return int(_C.nvshmem_stage_bytes(world))


def default_slab_bytes(world: int, groups: int = 2, options=None) -> int:
    """Room for ``groups`` groups' communication windows of ``world`` ranks (with these
    options' ring sizes; default: the ODC_* knobs'), plus 64 MiB."""
    return groups * _round4k(_window_bytes(world, options)) + _HEADROOM


def blocks_for(model, accumulate: str = "local") -> list[int]:
    """What a fully_shard model registers, block by block: a window for the world group and
    for each of its mesh's dimensions, then the decoupled-mode arena of ``odc.decouple(model,
    ..., accumulate=accumulate)`` ("local" is the mode that runs over NVSHMEM)."""
    from ._arena_sizing import plan_arena  # imports FSDP: only when a model is sized

    return blocks_for_plan(plan_arena(model, accumulate))  # raises without fully_shard modules


def blocks_for_plan(plan, options=None) -> list[int]:
    """``blocks_for`` of a model already read (``_arena_sizing.ArenaPlan``), with these
    options' ring sizes (default: the ODC_* knobs')."""
    return [_window_bytes(dist.get_world_size(), options)] * (plan.mesh.ndim + 1) + [plan.bytes()]


def _slab_holding(blocks: list[int]) -> int:
    return sum(_round4k(b) for b in blocks) + _HEADROOM


def slab_bytes_for(model, accumulate: str = "local") -> int:
    """The slab a fully_shard model needs: its ``blocks_for``, plus 64 MiB."""
    return _slab_holding(blocks_for(model, accumulate))


def _routed(world: int, options=None) -> bool:
    """Whether these options (default: the ODC_* knobs) put the default group's CUDA windows
    in NVSHMEM's heap (the backend's own decision, ``Options.uses_nvshmem``)."""
    k = options if options is not None else config.knobs()
    return k.uses_nvshmem(list(range(world)))


def routes_some_peer(global_ranks) -> bool:
    """Whether the knobs send some CUDA peer of a group with these global ranks over NVSHMEM
    (every peer with ``ODC_TRANSPORT=nvshmem``; peers on other hosts of ``ODC_HOST_SIZE``):
    the backend's own decision, ``Options.routes_some_peer``."""
    return config.knobs().routes_some_peer(list(global_ranks))


def init_from_backend(store, rank: int, world: int, options) -> bool:
    """Called by the default group's odc backend as it is created (on every rank), with the
    group's options: when they route some peer over NVSHMEM in an NVSHMEM build, initialise
    NVSHMEM with rank 0's unique id from the group's store and allocate the default slab for
    their ring sizes. Returns whether it did."""
    if not available() or not torch.cuda.is_available() or not _routed(world, options):
        return False
    uid = b""  # already up in this process: join it (its PE numbering is checked)
    if _C.nvshmem_status()["init_status"] < 2:
        if rank == 0:
            store.set(_UID_KEY, _C.nvshmem_unique_id())
        uid = store.get(_UID_KEY)  # waits for rank 0, up to the store's timeout
    _C.nvshmem_init(uid, rank, world, torch.cuda.current_device(),
                    default_slab_bytes(world, options=options))
    return True


def ensure_room(blocks: list[int]) -> int:
    """Collective over the default group: make sure the slab can hold ``blocks`` (bytes each,
    placed first fit like windows and arenas), growing it by one segment where some rank
    lacks room. Returns the bytes added (the same on every rank)."""
    _require()
    free = [b - u for b, u in _C.nvshmem_status()["segments"]]
    missing = 0
    for blk in blocks:
        need = _round4k(blk)
        i = next((i for i, f in enumerate(free) if f >= need), None)
        if i is None:
            missing += need
        else:
            free[i] -= need
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, missing)  # the segment must be the same size everywhere
    grow = max(everyone)
    if grow:
        _C.nvshmem_grow(grow)
    return grow


def init(slab_bytes: int | None = None, *, model=None) -> bool:
    """Initialise NVSHMEM over the default group (collective; every rank calls it).

    Allocates a slab of the symmetric heap for odc's windows and decoupled-mode arenas:
    ``slab_bytes``, or when some peer goes over NVSHMEM (``ODC_TRANSPORT=nvshmem`` or an
    ``ODC_HOST_SIZE`` split) what odc will register: ``slab_bytes_for(model)`` for a
    fully_shard ``model`` (call after fully_shard), else ``default_slab_bytes(world)`` (two
    groups' windows, no arena); otherwise none. Where a slab exists already (the default
    group's backend made one), grows it by what does not fit. Unless the environment sets
    it, ``NVSHMEM_SYMMETRIC_SIZE`` becomes the first slab + 512 MiB. Windows are never
    returned to the slab, and a window or arena that does not fit raises an error naming the
    bytes it needs.
    Returns True when this call initialised NVSHMEM, False when it was already up in this
    process (ours or PyTorch's; the PE numbering is checked either way).
    """
    _require()
    if not dist.is_initialized():
        raise RuntimeError("torch_odc_backend.nvshmem.init: call dist.init_process_group first")
    if not torch.cuda.is_available():
        raise RuntimeError("torch_odc_backend.nvshmem.init: NVSHMEM needs CUDA GPUs")
    rank, world = dist.get_rank(), dist.get_world_size()
    blocks = None  # what the slab must hold, for growing one that exists
    if slab_bytes is None:  # odc's windows need the slab when some peer goes over NVSHMEM
        if not _routed(world):
            slab_bytes = 0
        elif model is not None:
            blocks = blocks_for(model)
            slab_bytes = _slab_holding(blocks)
        else:
            slab_bytes = default_slab_bytes(world)
    # Every rank must agree whether NVSHMEM is up: a unique id is made (and its bootstrap
    # listener started) only when nobody has initialised it yet.
    states = [None] * world
    dist.all_gather_object(states, _C.nvshmem_status()["init_status"] >= 2)
    if all(states):
        had_slab = _C.nvshmem_status()["slab_bytes"] > 0  # the same on every rank (collective)
        fresh = _C.nvshmem_init(b"", rank, world, torch.cuda.current_device(), int(slab_bytes))
        if had_slab and slab_bytes:
            ensure_room(blocks or [int(slab_bytes)])
        return fresh
    if any(states):
        raise RuntimeError("torch_odc_backend.nvshmem.init: NVSHMEM is initialised on ranks "
                           f"{[r for r, up in enumerate(states) if up]} only")
    box = [_C.nvshmem_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return _C.nvshmem_init(box[0], rank, world, torch.cuda.current_device(), int(slab_bytes))


def status() -> dict:
    """NVSHMEM's state in this process: init_status (>= 2: initialised), my_pe, n_pes."""
    _require()
    return dict(_C.nvshmem_status())


def ring_selftest(nbytes: int, stream: torch.cuda.Stream | None = None) -> dict:
    """Collective: each PE puts ``nbytes`` into the next PE with put-with-signal and waits on
    the stream for its own signal; returns mismatched bytes, whether the next PE is
    reachable peer-to-peer, and the device time of put + wait in microseconds."""
    _require()
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, int(nbytes))  # a collective: unequal sizes would hang
    if len(set(sizes)) != 1:
        raise ValueError(f"torch_odc_backend.nvshmem.ring_selftest: ranks passed different sizes {sizes}")
    stream = stream or torch.cuda.current_stream()
    return dict(_C.nvshmem_ring_selftest(int(nbytes), stream.cuda_stream))
