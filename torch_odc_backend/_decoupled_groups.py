"""Decoupled mode's FSDP2 comm hooks, one set per FSDP module (parameter group): the
all-gather *gets* the owners' published shards, the reduce-scatter *adds* this rank's gradient
rows into the owners' accumulators (or a local sum). The state they act on is
``decoupled.DecoupledState``; its minibatch checks and failures go through its ``guard``
(``decoupled.MinibatchGuard``)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from . import _fsdp_adapter
from ._arena_sizing import _shard_sizes

_range = torch.autograd.profiler.record_function  # named ranges in torch.profiler traces


class _Group:
    """One FSDP module's parameter group: its layout and its comm objects."""

    def __init__(self, state, index: int, module: FSDPModule,  # state: decoupled.DecoupledState
                 policy: _fsdp_adapter.GroupPolicy, module_names: dict[int, str]):
        self.state, self.index, self.module = state, index, module
        # the Parameters bound for good: the optimizer steps them and sync writes their .grad
        self.params = policy.params
        for p in policy.params:
            if not isinstance(p, DTensor) or p.placements[-1] != Shard(0):
                raise ValueError("odc decoupled mode needs parameters sharded on dim 0 "
                                 f"(got placements {getattr(p, 'placements', None)})")
        self.divide_factor = policy.gradient_divide_factor  # None: FSDP2's default (the DP size)
        self.orig_dtype = policy.params[0].dtype
        self.param_dtype = policy.param_dtype or self.orig_dtype
        self.reduce_dtype = policy.reduce_dtype or self.param_dtype
        if self.reduce_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"odc decoupled mode reduces in float32 or bfloat16, not {self.reduce_dtype}")
        self.padded, self.trainable, self.numel, self.grad_numel = _shard_sizes(policy)
        bindings = _fsdp_adapter.shard_bindings(module)
        self.names = [".".join(n for n in (module_names.get(id(b.module), "?"), b.attr) if n)
                      for b in bindings]  # for messages: blocks.0.qkv.weight
        with torch.no_grad():  # the arena's layout: each local shard's dtype and device
            self.locals_layout = [(loc.dtype, loc.device) for loc in (p.to_local() for p in self.params)]
        # per parameter when last published: its local shard (which keeps that storage alive, so
        # a new one cannot reuse the address), the shard's address and the version counters of
        # the Parameter and of its shard (in-place ops through the DTensor bump the first,
        # on to_local() the second)
        self.published: list[tuple] | None = None
        # accumulate="local": this rank's summed reduce-scatter inputs (fp32), and an event
        # recorded after each add (FSDP2 runs them on its own stream; sync waits on it)
        self.local_acc = self.local_event = None
        if state.accumulate == "local":
            self.local_acc = self.new_local_acc()
            if state.device.type == "cuda":
                self.local_event = torch.cuda.Event()

    def new_local_acc(self) -> torch.Tensor:
        """accumulate="local"'s zeroed fp32 sums of this rank's reduce-scatter inputs."""
        return torch.zeros(self.state.world * self.grad_numel, dtype=torch.float32,
                           device=self.state.device)

    def refresh(self) -> None:
        self.divide_factor = _fsdp_adapter.group_policy(self.module).gradient_divide_factor

    def record_published(self) -> None:
        with torch.no_grad():
            self.published = [(local, local.data_ptr(), p._version, local._version)
                              for p, local in ((p, p.to_local()) for p in self.params)]

    def problems(self, since_published: bool) -> list[tuple[str, str, str]]:
        """(kind, parameter name, detail) of what is wrong with this group's parameters. Always:
        FSDP2 took a new Parameter ("replaced": load_state_dict(assign=True)) or the module
        holds one FSDP2 does not manage ("attribute": an assignment after fully_shard): the
        optimizer steps, and sync writes .grad to, the bound ones. Before a publish: a local
        shard of another dtype or device than the arena's layout ("layout"), or one FSDP2 does
        not all-gather from ("unshared": exact mode would gather other values); a new local
        shard under the same Parameter (nn.Module._apply, e.g. model.to()), which FSDP2 re-pads
        into its all-gather input, is fine: it is what gets published. Since the last publish:
        a local shard moved to new storage ("storage") or changed in place ("in_place").
        Cheap: identities, addresses and version counters, no values."""
        out = []
        bindings = _fsdp_adapter.shard_bindings(self.module)
        with torch.no_grad():
            for i, (b, p, name) in enumerate(zip(bindings, self.params, self.names)):
                if b.param is not p:
                    out.append(("replaced", name, ""))
                    continue
                if b.registered is not None and b.registered is not p:
                    out.append(("attribute", name, ""))
                    continue
                local = p.to_local()
                if not since_published:
                    dtype, device = self.locals_layout[i]
                    if (local.dtype, local.device) != (dtype, device):
                        out.append(("layout", name, f"{dtype} on {device} when odc.decouple bound "
                                                    f"it, now {local.dtype} on {local.device}"))
                    elif local.numel() and local.data_ptr() != b.all_gather_input.data_ptr():
                        out.append(("unshared", name, ""))
                elif self.published is not None:
                    _, ptr, version, local_version = self.published[i]
                    # an empty shard has no values to go stale (FSDP2 re-allocates those in every
                    # reset_sharded_param, e.g. after an in-place load_state_dict)
                    if local.numel() and local.data_ptr() != ptr:
                        out.append(("storage", name, ""))
                    elif (p._version, local._version) != (version, local_version):
                        out.append(("in_place", name, ""))
        return out

    def packed_shard(self) -> torch.Tensor:
        """This rank's shard as FSDP2 packs it for an all-gather: each parameter's local rows
        cast to param_dtype, zero-padded to the padded shard size, concatenated."""
        out = torch.zeros(self.numel, dtype=self.param_dtype, device=self.state.device)
        off = 0
        for p, padded in zip(self.params, self.padded):
            local = p.to_local().detach().reshape(-1)  # on the host with CPU offload
            out[off:off + local.numel()].copy_(local)
            off += padded
        return out

    def regroup_post_forward(self, gathered: torch.Tensor, out: torch.Tensor, k: int) -> None:
        """``reshard_after_forward=k`` (int): FSDP2's backward all-gather runs over a group of k
        ranks, and its output holds, for each of them in turn, the k-th part of every
        parameter's padded unsharded data (world/k consecutive shards of it), parameter after
        parameter. ``gathered`` is the world layout (every rank's packed shard, rank after
        rank); write the k-rank layout into ``out``."""
        per_rank = self.state.world // k
        src = gathered.view(k, per_rank, self.numel)
        dst = out.view(k, per_rank * self.numel)
        off = 0
        for padded in self.padded:
            dst[:, per_rank * off:per_rank * (off + padded)].view(k, per_rank, padded).copy_(
                src[:, :, off:off + padded])
            off += padded


class _AllGather:
    """FSDP2 all-gather comm: get every owner's published shard."""

    def __init__(self, group: _Group):
        self.group = group

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group=None, async_op=False):
        st = self.group.state
        st.guard.ensure_minibatch_open("forward/backward (all-gather)")
        if output_tensor.dtype != self.group.param_dtype or output_tensor.numel() != st.world * self.group.numel:
            raise RuntimeError("odc decoupled mode: FSDP2's all-gather layout differs from the "
                               f"published one (group {self.group.index})")
        k = group.size() if group is not None else st.world
        with _range("odc.get"), st.guard.unusable_on_error():
            if k == st.world:
                st.arena.get(self.group.index, output_tensor, st.epoch)
            else:  # reshard_after_forward=k: backward's all-gather over the post-forward group
                gathered = torch.empty_like(output_tensor)
                st.arena.get(self.group.index, gathered, st.epoch)
                self.group.regroup_post_forward(gathered, output_tensor, k)
        return None


class ZeroOutputs:
    """The outputs of decoupled mode's reduce-scatters, which stay zero (sync writes the
    gradients). FSDP2 makes each parameter's ``.grad`` a view of its group's output until
    sync, so separate zeros would hold a second gradient's worth of memory (4 bytes a
    parameter in fp32) beside the owners' accumulators through every backward. Every group
    shares one buffer per dtype and device instead, as large as the largest group's output;
    sync replaces the views with the gradients and checks that nothing wrote into it."""

    def __init__(self, largest: int):
        self.largest = largest  # the largest group's output, in elements
        self.buffers: dict[tuple, torch.Tensor] = {}  # (dtype, device) -> its zeros

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self.buffers.get((dtype, device))
        if buf is None:
            buf = self.buffers[(dtype, device)] = torch.zeros(self.largest, dtype=dtype, device=device)
        return buf[:numel]  # storage offset 0: FSDP2 views it with as_strided from there

    def aliases(self, grad: torch.Tensor) -> bool:
        """Whether a ``.grad`` (its local tensor) is a view of one of the buffers."""
        at = grad.untyped_storage().data_ptr()
        return any(at == buf.untyped_storage().data_ptr() for buf in self.buffers.values())

    def check(self) -> None:
        """At sync, after every view was replaced: raise if anything wrote into a buffer
        (it would have reached every group's ``.grad`` views), zeroing it again first."""
        written = [buf for buf in self.buffers.values() if torch.stack(buf.aminmax()).ne(0).any().item()]
        for buf in written:
            buf.zero_()
        if written:
            raise RuntimeError(
                "odc decoupled mode: a parameter's .grad was written during backward (by a "
                "post-accumulate-grad hook, an FSDP all-reduce hook, or an in-place edit between "
                "microbatches?). Until odc.sync, .grad is a view of zeros that every parameter "
                "group shares; edit gradients after odc.sync (or optimizer.step's pre-hook)")

    def release(self) -> None:
        self.buffers.clear()


class _ReduceScatter:
    """FSDP2 reduce-scatter comm: add this rank's rows into the owners' accumulators; FSDP's
    own output stays zero (sync writes the gradients)."""

    def __init__(self, group: _Group):
        self.group = group

    def allocate(self, size, *, dtype, device):
        g = self.group
        if g.state.mesh.ndim == 2 and math.prod(size) == g.grad_numel:
            # HSDP: FSDP2 keeps the output of a backward that does not all-reduce
            # (set_requires_all_reduce(False)) as a partial sum for a later all-reduce,
            # which decoupled mode never runs (sync writes the gradients). An empty tensor
            # stands in: a full one would hold a gradient's worth of zeros for the whole run
            # (torch 2.11 never frees it), and any use of it as a gradient fails loudly.
            return torch.empty(0, dtype=dtype, device=device)
        if math.prod(size) == g.grad_numel:  # the output, never written (the shard group has 2+ ranks)
            return g.state.zero_outputs.get(g.grad_numel, dtype, torch.device(device))
        return torch.zeros(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group=None, op=None, async_op=False):
        st = self.group.state
        st.guard.ensure_minibatch_open("backward (reduce-scatter)")
        if op is not None and op != dist.ReduceOp.SUM:
            raise RuntimeError(f"odc decoupled mode: unexpected reduce op {op} (expected SUM)")
        if input_tensor.numel() != st.world * self.group.grad_numel:
            st.guard.fail("the reduce-scatter input does not cover every trainable parameter of "
                          f"group {self.group.index} (a parameter without gradient?); every "
                          "trainable parameter must receive a gradient in each backward")
        st.guard.contributing()
        if st.accumulate == "local":
            g = self.group
            with _range("odc.local_accumulate"), st.guard.unusable_on_error():
                g.local_acc.add_(input_tensor.reshape(-1))
                if g.local_event is not None:
                    g.local_event.record()
        else:
            if st.early is not None:
                st.early.check_not_done(self.group.index)
            with _range("odc.put_accumulate"), st.guard.unusable_on_error():
                st.arena.accumulate(self.group.index, input_tensor.contiguous())
                if st.early is not None:
                    st.early.done_with(self.group.index)
        return None


def problem_text(kind: str, names: str, when: str, where: str, detail: str) -> str:
    """What is wrong with a group's parameter (a kind of _Group.problems), and what to do."""
    return {
        "replaced": f"parameter {names} was replaced by a new Parameter after odc.decouple "
                    "(e.g. load_state_dict(assign=True)): the optimizer and decoupled mode "
                    "hold the old one, so peers would gather its stale published shard and "
                    ".grad would go to the old object. Load checkpoints in place instead "
                    "(load_state_dict without assign=True, or torch.distributed.checkpoint."
                    "load), or replace parameters before creating the optimizer and calling "
                    "odc.decouple",
        "attribute": f"module attribute {names} was replaced by a Parameter FSDP2 does not "
                     "manage (assigned after fully_shard): FSDP2 keeps gathering its own and "
                     "drops the new one at its next reshard, in exact mode too. Assign "
                     "parameters before fully_shard, or copy the values into the existing "
                     f"Parameter in place (torch.no_grad(), param.copy_) {where}",
        "layout": f"the local shard of parameter {names} changed dtype or device ({detail}), "
                  "e.g. by model.to(): the published shards' layout is fixed by "
                  "odc.decouple; convert the model before it",
        "unshared": f"the local shard of parameter {names} is not the storage FSDP2 "
                    "all-gathers from any more (replaced behind FSDP2's back): exact mode "
                    "would gather other values than the published ones",
        "storage": f"the local shard of parameter {names} moved to new storage {when} (e.g. "
                   "by model.to()): peers may have gathered the old values already. Convert "
                   f"or move parameters only {where}",
        "in_place": f"parameter {names} was changed in place {when} (e.g. a checkpoint "
                    "loaded): peers may have gathered the old values already. Change "
                    f"parameters in place only {where}",
    }[kind]
