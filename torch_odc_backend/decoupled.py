"""Decoupled mode: FSDP2 with one synchronisation per minibatch.

    odc.decouple(model, optimizer)            # once, after fully_shard and the optimizer
    for minibatch in loader:
        for micro in microbatches:            # the count may differ per rank (0 too)
            loss(model(micro)).backward()
        odc.sync(model)                       # every contribution landed; .grad final
        optimizer.step(); optimizer.zero_grad()

Between two syncs no rank waits for another: each FSDP all-gather *gets* the owners'
published parameter shards (published after the previous optimizer step, so they cannot
change), and each reduce-scatter *adds* this rank's gradient rows into the owners' fp32
accumulators. ``sync`` is the minibatch's one synchronisation: it waits until every rank
has added everything, turns each accumulator into this rank's ``.grad`` (divided as FSDP2
divides, all-reduced once over the HSDP replicate dimension) and the optimizer step's
post-hook publishes the new shards.

A minibatch whose optimizer step is skipped (``GradScaler`` found inf/NaN gradients, or the
loop skips it) is fine: the next forward or ``sync`` starts the next minibatch from the same
parameters, and gradients then accumulate in ``.grad`` as FSDP2's would until
``zero_grad``. ``reshard_after_forward`` may be True, False or an int;
``set_gradient_divide_factor`` is honoured; with ``CPUOffloadPolicy`` the shards are
published from (and the gradients written to) host memory.

With HSDP (a replicate dimension, e.g. one replica a host), ``sync`` all-reduces each gradient
shard across the replicas. ``odc.last_microbatch(model)`` before a rank's last microbatch of
the minibatch starts those all-reduces during its backward instead: each parameter group's
as soon as every rank of the shard group is done with it (owners' accumulators only), so a slow
cross-host network overlaps the backward as FSDP2's own HSDP all-reduce does.

``accumulate="local"`` trades memory for speed: each rank adds its reduce-scatter inputs
into a local fp32 buffer (one unsharded gradient, +4 bytes per parameter) and ``sync``
reduce-scatters it once over the odc group, instead of atomic adds into the owners'
accumulators during backward (``"owner"``, whose atomics over NVLink can outlast short
backward layers: docs/performance.md). Unset, it is ``"owner"``, or ``"local"`` where the
shard group reaches some peer over NVSHMEM (``ODC_TRANSPORT=nvshmem``, peers on other hosts):
NVSHMEM has no floating-point atomics to add into a remote accumulator.

Only public FSDP2 extension points are used: ``set_custom_all_gather`` /
``set_custom_reduce_scatter``, ``set_requires_all_reduce``,
``set_force_sum_reduction_for_comms``, optimizer step hooks, ``DTensor.from_local``. The
mixed-precision policy and the group's parameters are read through ``_fsdp_adapter``. The
per-module comm hooks are in ``_decoupled_groups``, HSDP's early all-reduces in
``_early_reduction``.
Design notes and the facts they rest on: docs/decoupled_mode.md.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ._core import _C
from ._C import OdcBackend
from ._arena_sizing import _policies, plan_of_groups
from ._arena_sizing import arena_bytes  # noqa: F401 - still importable from here, as before
from ._decoupled_groups import ZeroOutputs, _AllGather, _Group, _ReduceScatter, problem_text
from ._early_reduction import _EarlyReduction, reduction_order

# torch 2.13 names it reduce_scatter_single (reduce_scatter_tensor warns there)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["decouple", "sync", "last_microbatch", "metrics", "DecoupledState", "MinibatchGuard"]

log = logging.getLogger("torch_odc_backend.decoupled")
_range = torch.autograd.profiler.record_function  # named ranges in torch.profiler traces

# The state lives on the model (an attribute, not a registry: a registry entry would keep
# the model, its local buffers and shards alive after the user drops them).
_STATE_ATTR = "_odc_decoupled_state"


def _state_of(model: torch.nn.Module) -> "DecoupledState | None":
    return model.__dict__.get(_STATE_ATTR)


def _require_state(model: torch.nn.Module, api: str) -> "DecoupledState":
    state = _state_of(model)
    if state is None:
        raise RuntimeError(f"{api}: the model is not in decoupled mode (call odc.decouple first)")
    return state


def _make_room_in_nvshmem_slab(plan, options) -> None:
    """Where odc's windows come from NVSHMEM's slab (routed peers), grow it for this
    model's windows (of these options' ring sizes) and arena unless it has room (collective
    over the default group)."""
    from . import nvshmem

    if nvshmem.available() and _C.nvshmem_status()["slab_bytes"] > 0:
        nvshmem.ensure_room(nvshmem.blocks_for_plan(plan, options))


class MinibatchGuard:
    """What the FSDP2 comm hooks (``_decoupled_groups``, ``_early_reduction``) may ask of a
    model's decoupled state before and while they move data: the state's own checks stay
    private to it."""

    def __init__(self, state: "DecoupledState"):
        self._state = state

    def ensure_minibatch_open(self, what: str) -> None:
        """Before ``what`` (e.g. "backward (reduce-scatter)") moves data: refuse if an earlier
        error left the state unusable; open the next minibatch (publish this rank's shards)
        if none is open, else check once per minibatch that the parameters are the ones
        published."""
        self._state._ensure_minibatch_open(what)

    def fail(self, reason: str) -> NoReturn:
        """Raise a failure inside the minibatch, leaving the state unusable (some
        contributions may have landed)."""
        self._state._fail(reason)

    def unusable_on_error(self) -> contextlib.AbstractContextManager[None]:
        """A block whose error (re-raised) leaves the state unusable, as ``fail`` does."""
        return self._state._unusable_on_error()

    def contributing(self) -> None:
        """A backward is about to add gradients (into the owners' accumulators or the local
        sums): until the minibatch's sync, odc.release would lose them, so it refuses."""
        self._state.in_use = True


class DecoupledState:
    """What ``decouple`` set up for one model; ``sync`` and the optimizer hooks drive it, the
    comm hooks through ``guard``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 accumulate: str | None = None):
        if accumulate not in (None, "owner", "local"):
            raise ValueError(f"odc.decouple: accumulate must be 'owner' or 'local', got {accumulate!r}")
        groups = _policies(model)  # the model is read here only
        first = groups[0][1].params[0]
        self.mesh = first.device_mesh
        # The mesh's device (the arena, the gets and adds); with CPU offload the parameters
        # and gradients live on the host and are copied to / from it.
        self.device = first.to_local().device
        if self.device.type != self.mesh.device_type:
            if self.mesh.device_type != "cuda":
                raise ValueError(f"odc decoupled mode: parameters on {self.device} but the mesh "
                                 f"is on {self.mesh.device_type}")
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.shard_dim = self.mesh.ndim - 1
        self.shard_pg = self.mesh.get_group(self.shard_dim)
        backend = self.shard_pg._get_backend(self.device)
        if not isinstance(backend, OdcBackend):
            raise ValueError(f"odc.decouple: the model's mesh moves {self.device.type} tensors with "
                             f"{backend.name()}, not odc; create it on an odc process group "
                             "(e.g. init_process_group('cpu:gloo,cuda:odc'))")
        self.backend = backend
        if accumulate is None:  # NVSHMEM has no float atomics for the owners' accumulators
            # the group's own routing, from the options it was made with
            routed = self.device.type == "cuda" and backend.options.routes_some_peer(
                dist.get_process_group_ranks(self.shard_pg))
            accumulate = "local" if routed else "owner"
        self.accumulate = accumulate
        self.replicate_pg = self.mesh.get_group(0) if self.mesh.ndim == 2 else None
        if self.replicate_pg is not None and self.replicate_pg.size() == 1:
            self.replicate_pg = None  # nothing to all-reduce
        # odc.last_microbatch can start the replicate all-reduces early (owners' accumulators)
        self.reduces_early = self.replicate_pg is not None and accumulate == "owner"
        self.world = self.shard_pg.size()
        if self.world < 2:
            raise ValueError("odc.decouple needs at least 2 ranks in the shard dimension (with one, "
                             "FSDP2 bypasses the reduce-scatter)")
        self.dp_size = self.world * (self.replicate_pg.size() if self.replicate_pg is not None else 1)
        module_names = {id(m): n for n, m in model.named_modules()}  # for messages
        self.groups = [_Group(self, i, m, pol, module_names) for i, (m, pol) in enumerate(groups)]
        for g in self.groups:
            if g.params[0].device_mesh != self.mesh:
                raise ValueError("odc.decouple: every fully_shard module must use the same mesh")
        # The epoch of the minibatch whose shards are published; 0: none yet. The first
        # minibatch's are published by this rank's first forward, odc.last_microbatch or sync,
        # so a checkpoint loaded in place after odc.decouple is what peers gather.
        self.epoch = 0
        self.synced = False
        # whether this minibatch's first forward, last_microbatch or sync checked that the
        # parameters are as published (set where the optimizer step's post-hook published them)
        self.checked = True
        self.broken = ""
        self.early: _EarlyReduction | None = None  # odc.last_microbatch in this minibatch
        self.guard = MinibatchGuard(self)  # for the comm hooks
        # observability: wall time working vs waiting in sync, per minibatch and in total
        self._since = time.perf_counter()
        # early_all_reduces: groups whose cross-replica all-reduce odc.last_microbatch started
        self.totals = {"busy_s": 0.0, "sync_wait_s": 0.0, "minibatches": 0, "skipped_steps": 0,
                       "early_all_reduces": 0}
        self.last = {}
        plan = plan_of_groups(groups, accumulate)
        if self.device.type == "cuda":
            _make_room_in_nvshmem_slab(plan, backend.options)
        self._arena_sizes = plan.sizes
        self.zero_outputs = ZeroOutputs(max(g.grad_numel for g in self.groups))  # FSDP2's RS outputs
        self.arena = backend.create_arena(self.device, *plan.sizes)
        # odc.release: the arena (and accumulate="local"'s buffers) given back until odc.restore
        self.released = False
        # gradients were added, or the minibatch's end began (last_microbatch, sync), since the
        # last publish: odc.release would lose them (gets alone it need not wait for: it
        # finishes the device's work first, and restore publishes the shards again)
        self.in_use = False
        for g in self.groups:
            g.module.set_custom_all_gather(_AllGather(g))
            g.module.set_custom_reduce_scatter(_ReduceScatter(g))
            g.module.set_force_sum_reduction_for_comms(True)
            g.module.set_requires_all_reduce(False)  # HSDP: sync all-reduces once per minibatch
        self._hooks = [optimizer.register_step_pre_hook(self._before_step),
                       optimizer.register_step_post_hook(self._after_step)]

    # ---- phases
    def _fail(self, reason: str) -> NoReturn:
        """A failure inside a minibatch: some contributions may have landed, so the state
        cannot be trusted any more."""
        self.broken = reason
        raise RuntimeError(f"odc decoupled mode: {reason}")

    @contextlib.contextmanager
    def _unusable_on_error(self):
        try:
            yield
        except Exception as e:  # noqa: BLE001
            self.broken = f"{type(e).__name__}: {e}"
            raise

    def _check_usable(self, what: str) -> None:
        if self.broken:
            raise RuntimeError("odc decoupled mode is unusable after an earlier error inside a "
                               f"minibatch ({self.broken}); {what} cannot run")
        if self.released and what != "odc.restore":
            raise RuntimeError(f"odc decoupled mode: the model's arena was released (odc.release); "
                               f"call odc.restore(model) before {what}")

    def _ensure_minibatch_open(self, what: str) -> None:
        self._check_usable(what)
        if self.synced or self.epoch == 0:
            self._next_minibatch(stepped=False)
        elif not self.checked:
            self._check_unchanged()

    def _publish(self) -> None:
        for g in self.groups:
            self._refuse(g.problems(since_published=False))
        for g in self.groups:
            g.refresh()
            self.arena.publish(g.index, g.packed_shard())
            g.record_published()
        self.arena.announce(self.epoch)

    def _check_unchanged(self) -> None:
        """Once at the first forward / last_microbatch / sync of a minibatch the optimizer
        step's post-hook published, and again in sync: the parameters must still be the ones
        published (peers may have gathered them already)."""
        for g in self.groups:
            self._refuse(g.problems(since_published=True))
        self.checked = True

    def _refuse(self, problems: list) -> None:
        """Fail with a message naming the first problem's parameter, what happened to it and
        what to do instead (problems: _Group.problems)."""
        if not problems:
            return
        kind, name, detail = problems[0]
        more = sum(1 for k, _, _ in problems[1:] if k == kind)
        names = f"'{name}'" + (f" (and {more} more in its FSDP module)" if more else "")
        when = ("during the minibatch, after it was published" if self.checked else
                f"after optimizer.step() published it for minibatch {self.epoch}")
        where = ("before the first forward after odc.decouple, or after odc.sync(model) and "
                 "before optimizer.step() (which publishes them)")
        self._fail(problem_text(kind, names, when, where, detail))

    def _before_step(self, optimizer, args, kwargs):
        self._check_usable("optimizer.step()")
        if not self.synced:
            raise RuntimeError("odc decoupled mode: optimizer.step() without odc.sync(model) "
                               "since the last step; call odc.sync(model) after the minibatch's "
                               "backward passes")

    def _after_step(self, optimizer, args, kwargs):
        self._next_minibatch(stepped=True)

    def _next_minibatch(self, stepped: bool) -> None:
        """Open the next minibatch: publish this rank's shards for the next epoch. Without an
        optimizer step since the sync (GradScaler skipped it, or the loop did), the shards are
        the same, or changed in place after the sync; every rank opens the epoch exactly once
        per sync either way (and the first one at its first forward or sync), so they agree."""
        if not stepped and self.epoch > 0:
            log.info("odc: minibatch %d ended without an optimizer step (skipped, e.g. by "
                     "GradScaler); the next one starts from the same parameters", self.epoch)
            self.totals["skipped_steps"] += 1
        self.epoch += 1
        self.synced = False
        self.in_use = False
        self.early = None
        self._publish()
        # published at the optimizer step: the first forward or sync checks for changes since
        self.checked = not stepped
        self._since = time.perf_counter()

    def last_microbatch(self) -> None:
        """The next backward is this rank's last of the minibatch (see last_microbatch)."""
        self._ensure_minibatch_open("odc.last_microbatch")
        self.in_use = True
        if not self.reduces_early:
            return  # nothing to reduce across replicas, or nothing to take before sync
        if self.early is not None and self.early.done:
            self._fail("odc.last_microbatch was called again after the backward it announced")
        if self.early is None:
            self.early = _EarlyReduction(self)

    def sync(self) -> None:
        self._check_usable("odc.sync")
        if self.synced or self.epoch == 0:  # no forward since the last sync and no step (or
            self._next_minibatch(stepped=False)  # none yet): an empty minibatch here
        self._check_unchanged()  # before this rank says it is done: its .grad stays untouched
        self.in_use = True
        with _range("odc.sync"), torch.no_grad(), self._unusable_on_error():
            self._sync()
        self.zero_outputs.check()  # the gradients written are right either way

    def release(self) -> None:
        if self.released:
            return
        self._check_usable("odc.release")
        if self.in_use and not self.synced:
            raise RuntimeError("odc.release: call it between minibatches (after odc.sync(model) "
                               "or optimizer.step()), not during one: peers may still read this "
                               "rank's shards or add into its accumulators")
        with self._unusable_on_error():
            self._kept = not self.arena.release()  # NVSHMEM keeps its heap: the arena stays
        for g in self.groups:  # no reference to the local shards (their storage may be offloaded)
            g.published = None
            g.local_acc = None
        self.zero_outputs.release()
        self.released = True

    def restore(self) -> None:
        if not self.released:
            return
        self._check_usable("odc.restore")
        problems = [p for g in self.groups for p in g.problems(since_published=False)]
        if problems:  # e.g. still on the host: the arena's layout is where odc.decouple bound it
            kind, name, detail = problems[0]
            raise RuntimeError(f"odc.restore: parameter '{name}' is not as odc.decouple bound it "
                               f"({detail or kind}); load the model back first")
        with self._unusable_on_error():
            for g in self.groups:
                if self.accumulate == "local":
                    g.local_acc = g.new_local_acc()
            if not self._kept:
                self.arena = self.backend.create_arena(self.device, *self._arena_sizes)
            self.released = False
            if self.epoch == 0 or self.synced:
                return  # nothing published that a peer still needs
            if not self._kept:  # the minibatch published before the release, again
                self._publish()
                return
            for g in self.groups:  # the kept arena holds the published values (peers may be
                g.refresh()  # reading them): bind the moved shards, write nothing
                g.record_published()

    def metrics(self) -> dict:
        """This rank's time: busy (between syncs) and in sync (waiting for the other ranks,
        then writing the gradients), last minibatch and in total; bubble_rate = sync /
        (busy + sync)."""
        t = self.totals
        total = t["busy_s"] + t["sync_wait_s"]
        return {**{f"last_{k}": v for k, v in self.last.items()}, **t,
                "bubble_rate": t["sync_wait_s"] / total if total > 0 else 0.0}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            for g in self.groups:  # accumulate="local": the adds ran on FSDP2's stream
                if g.local_event is not None:
                    stream.wait_event(g.local_event)  # a no-op before the first record
            stream.synchronize()
        t0 = time.perf_counter()
        # with HSDP in owner mode peers may take accumulators early: say this rank is done
        # with every group (those its announced backward did not reach included)
        self.arena.finish(self.epoch, self.reduces_early)
        issued, todo = {}, reduction_order(self.groups)
        if self.reduces_early:
            # HSDP in owner mode: the groups odc.last_microbatch's backward reduced early, then
            # the rest, issued now in the order every rank issues them; each is taken (on the
            # side stream) once the shard group is done with it, so the cross-replica
            # all-reduces need not wait for the slowest shard peer's whole backward
            early = self.early if self.early is not None else _EarlyReduction(self)
            self.totals["early_all_reduces"] += len(early.issued)
            early.issue_rest()
            issued, todo = early.issued, []
        # Otherwise one group at a time: the gradient temporaries add at most the largest
        # group's size to peak memory (in 1-D FSDP, FSDP2 already holds the zero gradients
        # its reduce-scatters made, and the sums are added into them).
        for g in [self.groups[i] for i in [*issued, *todo]]:
            if g.index in issued:
                acc, work = issued.pop(g.index)
                work.wait()  # the current stream waits for the all-reduce (NCCL's stream)
                if self.device.type == "cuda":
                    acc.record_stream(torch.cuda.current_stream(self.device))
            else:
                acc = torch.empty(g.grad_numel, dtype=torch.float32, device=self.device)
                if self.accumulate == "owner":
                    self.arena.take(g.index, acc)
                else:  # one reduce-scatter of the local sums (zeros from a rank without backward)
                    _reduce_scatter(acc, g.local_acc, group=self.shard_pg)
                    g.local_acc.zero_()
                if self.replicate_pg is not None:
                    dist.all_reduce(acc, group=self.replicate_pg)
            # FSDP2 divides by set_gradient_divide_factor's factor, else by the DP size (the mean)
            acc.div_(g.divide_factor if g.divide_factor is not None else self.dp_size)
            off = 0
            for p, padded, trainable in zip(g.params, g.padded, g.trainable):
                if not trainable:
                    continue
                local = p.to_local()  # on the host with CPU offload
                val = acc[off:off + local.numel()].view(local.shape).to(device=local.device,
                                                                        dtype=p.dtype)
                off += padded
                if p.grad is not None and self.zero_outputs.aliases(p.grad.to_local()):
                    p.grad = None  # FSDP2's view of the shared zero output (ZeroOutputs)
                if p.grad is None and local.device.type == p.device_mesh.device_type:
                    p.grad = DTensor.from_local(val, p.device_mesh, p.placements,
                                                shape=p.shape, stride=p.stride())
                elif p.grad is None:  # CPU offload: from_local would move val to the mesh's device
                    p.grad = torch.empty_like(p)
                    p.grad.to_local().copy_(val)
                else:
                    p.grad.to_local().add_(val)
            del acc  # freed before the next group's is allocated
        if self.device.type == "cuda":  # the wait includes the reduce-scatters and all-reduces
            torch.cuda.current_stream(self.device).synchronize()
        t1 = time.perf_counter()
        busy, wait = t0 - self._since, t1 - t0
        self.last = {"busy_s": busy, "sync_wait_s": wait,
                     "bubble_rate": wait / (busy + wait) if busy + wait > 0 else 0.0}
        self.totals["busy_s"] += busy
        self.totals["sync_wait_s"] += wait
        self.totals["minibatches"] += 1
        log.info("odc sync epoch %d: busy %.3fs, %.3fs in sync (bubble %.1f%%)",
                 self.epoch, busy, wait, 100 * self.last["bubble_rate"])
        self.synced = True


def decouple(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
             accumulate: str | None = None) -> DecoupledState:
    """Switch a fully_shard model on an odc mesh to decoupled mode (collective: call it on
    every rank, after fully_shard and after creating the optimizer).

    ``accumulate``: ``"owner"`` adds gradient rows into the owners' accumulators during
    backward; ``"local"`` sums them in a local fp32 buffer (+4 bytes per parameter) and
    reduce-scatters once in ``sync``. Unset: ``"owner"``, or ``"local"`` where the shard
    group reaches a peer over NVSHMEM (no floating-point atomics there)."""
    if _state_of(model) is not None:
        raise RuntimeError("odc.decouple: this model is in decoupled mode already")
    state = DecoupledState(model, optimizer, accumulate)
    model.__dict__[_STATE_ATTR] = state
    return state


def sync(model: torch.nn.Module) -> None:
    """End a minibatch in decoupled mode (collective): afterwards every sharded parameter's
    ``.grad`` holds the minibatch's gradient, as FSDP2 would have produced it."""
    _require_state(model, "odc.sync").sync()


def last_microbatch(model: torch.nn.Module) -> None:
    """Announce that this rank's next backward is its last of the minibatch (optional; call
    before that microbatch's forward or backward). With HSDP the cross-replica all-reduce of
    each parameter group then starts during that backward, once every rank of the shard group
    is done with the group, on a side stream, instead of in ``sync``. A rank that runs no
    microbatch, or does not call it, reduces in ``sync`` as before; results are the same. No
    effect without a replicate dimension or with ``accumulate="local"``. A backward after the
    announced one raises (its gradients would miss the reductions already started)."""
    _require_state(model, "odc.last_microbatch").last_microbatch()


def release(model: torch.nn.Module) -> None:
    """Give back what decoupled mode holds on the device for ``model`` (its arena: the published
    shards and the owners' accumulators; ``accumulate="local"``'s buffers) and let go of its
    parameters' local shards, e.g. before a trainer offloads the model to the host. Collective
    over the model's shard group, between minibatches (after ``odc.sync`` or
    ``optimizer.step()``); nothing of the model may run in decoupled mode until
    :func:`restore`. On NVSHMEM's heap the arena is kept (the heap does not give memory back)."""
    _require_state(model, "odc.release").release()


def restore(model: torch.nn.Module) -> None:
    """After :func:`release` and once the parameters are back on their device: a new arena,
    with the parameters published for the minibatch that was open (collective). Their storage
    may have changed (the values must be the same)."""
    _require_state(model, "odc.restore").restore()


def metrics(model: torch.nn.Module) -> dict:
    """Decoupled-mode timing of this rank (see DecoupledState.metrics)."""
    return _require_state(model, "odc.metrics").metrics()
