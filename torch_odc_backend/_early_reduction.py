"""HSDP: the cross-replica all-reduces of one minibatch's gradients, started as soon as a
parameter group's shard group is done with it (``odc.last_microbatch``, and the rest in
``odc.sync``), in one order on every rank so that the replicas' calls match."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

_range = torch.autograd.profiler.record_function  # named ranges in torch.profiler traces


def reduction_order(groups: list) -> list[int]:
    """The order every rank all-reduces the groups' gradients across replicas in: backward's,
    the reverse of the model's, leaving out groups without trainable parameters (FSDP2 never
    reduce-scatters those)."""
    return [g.index for g in reversed(groups) if g.grad_numel > 0]


class _EarlyReduction:
    """One minibatch's cross-replica all-reduces started during the rank's last backward
    (``odc.last_microbatch``). Every rank issues the all-reduces of the groups in one fixed
    order (the reverse of their order in the model: backward's order), each once per
    minibatch, early or at sync, so the replicas' NCCL calls match. A group is issued early
    once this rank's last backward reduce-scattered it and every group before it in that
    order was issued; its owner's accumulator is taken (on a side stream) once every rank of
    the shard group said it is done with the group (at the latest in its sync)."""

    def __init__(self, state):
        self.state = state
        self.order = reduction_order(state.groups)
        self.next = 0  # order[:next] are issued
        self.done: set[int] = set()
        self.issued: dict[int, tuple[torch.Tensor, object]] = {}  # group -> (accumulator, work)
        self.stream = (torch.cuda.ExternalStream(state.arena.side_stream(), device=state.device)
                       if state.device.type == "cuda" else None)

    def check_not_done(self, index: int) -> None:
        """Before a reduce-scatter adds anything: none after the announced backward's."""
        if index in self.done:
            self.state.guard.fail("a backward after the one odc.last_microbatch announced "
                                  f"reduce-scattered parameter group {index} again, whose "
                                  "reduction across replicas has started")

    def done_with(self, index: int) -> None:
        st = self.state
        self.done.add(index)
        st.arena.group_done(index, st.epoch)  # on FSDP2's stream, after the accumulate
        while self.next < len(self.order) and self.order[self.next] in self.done:
            self._issue(self.order[self.next])
            self.next += 1

    def _issue(self, index: int) -> None:
        st = self.state
        # allocated on the issuing stream (FSDP2's reduce-scatter stream, whose freed input
        # buffers it may reuse), used on the side stream after everything issued before it
        acc = torch.empty(st.groups[index].grad_numel, dtype=torch.float32, device=st.device)
        side = contextlib.nullcontext()
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(st.device))
            acc.record_stream(self.stream)
            side = torch.cuda.stream(self.stream)
        with _range("odc.early_all_reduce"), side:
            st.arena.take_when_done(index, acc, st.epoch)
            work = dist.all_reduce(acc, group=st.replicate_pg, async_op=True)
        self.issued[index] = (acc, work)

    def issue_rest(self) -> None:
        """In sync, after this rank's finish: issue the groups not issued yet, in order, each
        taken once every rank of the shard group is done with it, so that one rank's
        all-reduces overlap the backward of a shard peer that announced its last microbatch."""
        while self.next < len(self.order):
            self._issue(self.order[self.next])
            self.next += 1
