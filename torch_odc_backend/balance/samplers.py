"""Samplers and dataset views that feed balanced plans through a DataLoader: each epoch the
dataset is shuffled and cut into minibatches (:class:`_Minibatches`), :class:`BalancedBatchSampler`
yields this rank's planned microbatches of each minibatch, and :class:`MinibatchDataset` /
:class:`MicrobatchDataset` turn index lists into collated batches, so a plain DataLoader with
``batch_size=None`` keeps its worker processes and pinning."""
from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import Dataset, Sampler, default_collate

from ._checks import _check_lengths, _check_positive_int, _check_rank
from .cost import CostModel
from .plan import _PLANNERS, Plan, _check_mode


class _Minibatches:
    """A dataset's samples, shuffled per epoch and cut into minibatches (shared by the samplers).

    Each epoch the dataset is shuffled (``torch.randperm`` seeded with ``seed + epoch``, as
    ``DistributedSampler`` does) and cut into minibatches of ``minibatch_size`` samples
    (global, over all ranks); the last one is smaller unless ``drop_last``.
    """

    def _init_minibatches(self, lengths: Sequence[int], max_tokens: int, minibatch_size: int,
                          cost: CostModel, seed: int, shuffle: bool, drop_last: bool) -> None:
        self.lengths = _check_lengths(lengths)
        self.max_tokens = _check_positive_int(max_tokens, "max_tokens")
        for i, length in enumerate(self.lengths):
            if length > max_tokens:
                raise ValueError(f"dataset sample {i} has {length} tokens, "
                                 f"more than max_tokens={max_tokens}")
        self.minibatch_size = _check_positive_int(minibatch_size, "minibatch_size")
        if not callable(cost):
            raise ValueError(f"cost must be callable (a cost model), got {cost!r}")
        self.cost = cost
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.seed = seed
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._order: list[int] | None = None
        self._order_epoch = -1

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's shuffle; call before iterating, with the same value on all ranks."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        self.epoch = epoch

    def __len__(self) -> int:
        n, m = len(self.lengths), self.minibatch_size
        return n // m if self.drop_last else -(-n // m)

    def _epoch_order(self) -> list[int]:
        if self._order is None or self._order_epoch != self.epoch:
            if self.shuffle:
                generator = torch.Generator()
                generator.manual_seed(self.seed + self.epoch)
                self._order = torch.randperm(len(self.lengths), generator=generator).tolist()
            else:
                self._order = list(range(len(self.lengths)))
            self._order_epoch = self.epoch
        return self._order

    def minibatch_indices(self, index: int) -> list[int]:
        """Dataset indices of minibatch ``index`` of the current epoch."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self):
            raise ValueError(f"minibatch index must be in [0, {len(self)}), got {index!r}")
        start = index * self.minibatch_size
        return self._epoch_order()[start:start + self.minibatch_size]


class BalancedBatchSampler(_Minibatches, Sampler[list[list[int]]]):
    """Yields, per minibatch, this rank's microbatches (lists of dataset indices).

    Each epoch the dataset is shuffled (``torch.randperm`` seeded with ``seed + epoch``,
    as ``DistributedSampler`` does) and cut into minibatches of ``minibatch_size``
    samples (global, over all ranks); each minibatch is planned with :func:`lb_mini` or
    :func:`lb_micro`. Every rank computes the same plan, so no communication is needed;
    the union over ranks of a minibatch's microbatches is the minibatch, each index once.
    Call :meth:`set_epoch` before each epoch. ``len(sampler)`` is the number of
    minibatches; the last one is smaller unless ``drop_last``.

    Use it as the ``sampler`` of a DataLoader with ``batch_size=None`` over a
    :class:`MinibatchDataset`, which turns each yielded list into a list of collated
    microbatches, so the DataLoader delivers one minibatch per item, with worker processes
    and pinning as usual::

        from torch.utils.data import DataLoader
        from torch_odc_backend.balance import BalancedBatchSampler, MinibatchDataset, TransformerCost

        cost = TransformerCost.from_hf_config(model.config)
        sampler = BalancedBatchSampler(lengths, world_size, rank, max_tokens=65536,
                                       minibatch_size=64, cost=cost, mode="lb_mini")
        # pack_documents: your collate, e.g. concatenating documents with their positions
        loader = DataLoader(MinibatchDataset(dataset, collate_fn=pack_documents),
                            sampler=sampler, batch_size=None, num_workers=2)
        for epoch in range(num_epochs):
            sampler.set_epoch(epoch)
            for micros in loader:            # this rank's share of one minibatch
                for micro in micros:         # the count may differ per rank, even be 0
                    model(**micro).loss.backward()
                odc.sync(model)  # decoupled mode (odc.decouple): one sync per minibatch; with
                # exact-mode FSDP every layer synchronises, so use mode="lb_micro" there
                optimizer.step(); optimizer.zero_grad()

    Since ranks hold different numbers of tokens, normalise the loss by the minibatch's
    *global* token (or sample) count rather than a per-rank mean; :meth:`plan` gives every
    rank's share, so that count is known locally.
    """

    def __init__(self, lengths: Sequence[int], world_size: int, rank: int, max_tokens: int,
                 minibatch_size: int, cost: CostModel, mode: str = "lb_mini", seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False) -> None:
        self.world_size = _check_positive_int(world_size, "world_size")
        self.rank = _check_rank(rank, world_size)
        self._init_minibatches(lengths, max_tokens, minibatch_size, cost, seed, shuffle, drop_last)
        _check_mode(mode)
        self.mode = mode

    def plan(self, index: int) -> Plan:
        """Every rank's microbatches (dataset indices) for minibatch ``index``."""
        indices = self.minibatch_indices(index)
        local = _PLANNERS[self.mode]([self.lengths[i] for i in indices], self.world_size,
                                     self.max_tokens, self.cost)
        return [[[indices[i] for i in mb] for mb in rank_plan] for rank_plan in local]

    def __iter__(self) -> Iterator[list[list[int]]]:
        for index in range(len(self)):
            yield self.plan(index)[self.rank]


class MinibatchDataset(Dataset):
    """Map-style view whose items are minibatches: ``view[plan] -> list of collated microbatches``.

    ``plan`` is what :class:`BalancedBatchSampler` yields (a list of microbatches, each a
    list of indices of ``dataset``); each microbatch becomes
    ``collate_fn([dataset[i] for i in microbatch])``. An empty microbatch (LB-Micro
    padding) is passed to ``collate_fn`` as ``[]``.
    """

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any] = default_collate) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn

    def __getitem__(self, plan: Sequence[Sequence[int]]) -> list[Any]:
        return [self.collate_fn([self.dataset[i] for i in microbatch]) for microbatch in plan]


class MicrobatchDataset(Dataset):
    """Map-style view whose items are microbatches: ``view[indices] -> collate_fn(samples)``.

    The DataLoader companion of :class:`MinibatchClaims` (``sampler=claims``, ``batch_size=None``).
    """

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any] = default_collate) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn

    def __getitem__(self, indices: Sequence[int]) -> Any:
        return self.collate_fn([self.dataset[i] for i in indices])
