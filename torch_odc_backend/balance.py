"""Workload balancing for variable-length training: LB-Micro and LB-Mini.

With variable-length samples packed into token-capped microbatches, the time of a
microbatch grows with its tokens (the matmuls) and with the squares of its document
lengths (attention; each document attends only within itself). Two ways to spread a
minibatch over ``world_size`` data-parallel ranks:

* **LB-Micro** (:func:`lb_micro`): every rank runs the *same number* of microbatches,
  and microbatch ``j`` of all ranks forms one synchronous step (what per-layer FSDP
  collectives force). Balance is only possible *within* each step; the minibatch takes
  ``sum over steps of the slowest rank``.
* **LB-Mini** (:func:`lb_mini`): with on-demand communication ranks synchronise once
  per minibatch, so counts may differ (zero included) and only each rank's *total*
  matters; the minibatch takes ``max over ranks of the rank's total``.

:func:`plan_stats` predicts both times for any plan. The building blocks are a cost
model (:class:`TransformerCost` from a model config, :class:`FittedCost` from
measurements; any callable mapping a microbatch's document lengths to a non-negative
cost works), token-capped packing (:func:`pack`) and multi-way number partitioning
(:func:`karmarkar_karp`, :func:`greedy_partition`, and the brute-force
:func:`optimal_partition` for checking them on small cases).

Every planning function is deterministic: all ranks compute the identical plan from the
same inputs, so no communication is needed to agree on it.

**Dynamic balancing** (:class:`DynamicBatchSampler`, :class:`DynamicBalancer`; decoupled
mode only): each minibatch starts from an LB-Mini plan weighted by the ranks' measured
speeds (:func:`lb_mini_weighted`), and ranks then *take* work as they become free: their own
queue first (most expensive microbatch first), then single items from the back of the
fullest queue of another rank, each take an atomic fetch-add on a counter of the group's
store. A straggler (a throttled GPU, a cost-model error) hands its tail to ranks that are
free, and a rank that stays slow gets smaller shares in later plans; each microbatch is
trained exactly once, and ``odc.sync`` stays the one synchronisation::

    sampler = DynamicBatchSampler(lengths, max_tokens=65536, minibatch_size=64, cost=cost)
    for epoch in range(num_epochs):
        sampler.set_epoch(epoch)
        for claims in sampler:               # one per minibatch, the same on every rank
            for micro in claims:             # this rank's next microbatch, taken when it is free
                batch = pack_documents([dataset[i] for i in micro])
                (model(**batch).loss * batch_tokens(batch) / claims.num_tokens).backward()
            odc.sync(model)
            optimizer.step(); optimizer.zero_grad()

Use with a DataLoader: :class:`BalancedBatchSampler` yields, per minibatch, this rank's
list of microbatches (each a list of dataset indices; the list may be empty under
LB-Mini). :class:`MinibatchDataset` turns such a list into a list of collated
microbatches, so a plain DataLoader with ``batch_size=None`` delivers one minibatch per
item, with worker processes and pinning as usual::

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
*global* token (or sample) count rather than a per-rank mean; ``sampler.plan(i)`` gives
every rank's share, so that count is known locally.
"""
from __future__ import annotations

import heapq
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch.utils.data import Dataset, Sampler, default_collate

__all__ = [
    "CostModel",
    "TransformerCost",
    "FittedCost",
    "pack",
    "karmarkar_karp",
    "greedy_partition",
    "optimal_partition",
    "lb_micro",
    "lb_mini",
    "plan_stats",
    "microbatches",
    "BalancedBatchSampler",
    "MinibatchDataset",
    "lb_mini_weighted",
    "DynamicBalancer",
    "MinibatchClaims",
    "DynamicBatchSampler",
    "MicrobatchDataset",
    "balance_bound",
]

#: A cost model maps the document lengths of one packed microbatch to its cost (FLOPs,
#: seconds, any unit). It is also called with the empty list (the fixed cost of a
#: microbatch, 0 if none). It must return a finite value >= 0 and should not decrease
#: when a document is added.
CostModel = Callable[[Sequence[int]], float]

#: A plan: per rank, a list of microbatches, each a list of sample indices.
Plan = list[list[list[int]]]

_OPTIMAL_PARTITION_MAX_ITEMS = 12


# --------------------------------------------------------------------------- validation


def _check_lengths(lengths: Iterable[Any], name: str = "lengths") -> list[int]:
    out = []
    for i, value in enumerate(lengths):
        try:
            if isinstance(value, bool):
                raise TypeError
            length = operator.index(value)
        except TypeError:
            raise ValueError(f"{name}[{i}] = {value!r} is not an integer") from None
        if length < 0:
            raise ValueError(f"{name}[{i}] = {length} is negative")
        out.append(length)
    return out


def _check_positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_fits(lengths: Sequence[int], max_tokens: int) -> None:
    """Every sample must fit in one microbatch; name the first that does not."""
    for i, length in enumerate(lengths):
        if length > max_tokens:
            raise ValueError(f"sample {i} has {length} tokens, more than max_tokens={max_tokens}")


def _check_rank(rank: Any, world_size: int) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    return rank


def _check_mode(mode: Any) -> Callable[..., Plan]:
    """The planner of ``mode`` ("lb_mini" or "lb_micro")."""
    if mode not in _PLANNERS:
        raise ValueError(f"mode must be one of {sorted(_PLANNERS)}, got {mode!r}")
    return _PLANNERS[mode]


def _check_costs(costs: Iterable[Any]) -> list[float]:
    out = []
    for i, value in enumerate(costs):
        try:
            c = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"costs[{i}] = {value!r} is not a number") from None
        if not math.isfinite(c) or c < 0:
            raise ValueError(f"costs[{i}] = {value!r} must be finite and >= 0")
        out.append(c)
    return out


def _eval_cost(cost: CostModel, lengths: Sequence[int]) -> float:
    value = float(cost(lengths))
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"cost model returned {value!r} for document lengths {list(lengths)}; "
                         "costs must be finite and >= 0")
    return value


# --------------------------------------------------------------------------- cost models


@dataclass(frozen=True)
class TransformerCost:
    """Training FLOPs of a packed microbatch of a dense decoder-only transformer.

    ``cost(lengths) = sum_i (flops_per_token * n_i + attention_flops(n_i))``:

    * linear term: every token passes through the matmul weights once per layer, plus
      the LM head; 2 FLOPs per multiply-add, times ``linear_training_factor`` for
      forward + backward (3: the backward pass costs two forwards; the usual "6 x
      parameters per token"; use 4 with activation recomputation);
    * attention term: per layer, each (query, key) pair costs ``4 * num_heads *
      head_dim`` forward FLOPs (``QK^T`` and ``PV``); a causal document of length n has
      ``n (n + 1) / 2`` pairs (``n^2`` when ``causal=False``); documents packed together
      do not attend to each other. ``attention_training_factor`` is 3.5 by default:
      a flash-attention backward recomputes ``QK^T`` and runs four more matmuls.

    Norms, activations, softmax and the embedding lookup are ignored. Mixture-of-experts
    layers are not modelled (set ``intermediate_size`` to the active experts' total).
    """

    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    vocab_size: int
    num_kv_heads: int | None = None  # None: same as num_heads (no grouped-query attention)
    head_dim: int | None = None  # None: hidden_size // num_heads
    gated_mlp: bool = True  # SwiGLU-style MLP with three matrices (Llama, Qwen, Mistral)
    causal: bool = True
    linear_training_factor: float = 3.0
    attention_training_factor: float = 3.5

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "intermediate_size", "num_heads", "vocab_size"):
            _check_positive_int(getattr(self, name), name)
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        _check_positive_int(self.num_kv_heads, "num_kv_heads")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size={self.hidden_size} is not divisible by "
                                 f"num_heads={self.num_heads}; pass head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        _check_positive_int(self.head_dim, "head_dim")
        for name in ("linear_training_factor", "attention_training_factor"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")

    @classmethod
    def from_hf_config(cls, config: Any, **overrides: Any) -> TransformerCost:
        """Build from a transformers-style config object (read with ``getattr``).

        Reads ``hidden_size``, ``num_hidden_layers``, ``intermediate_size``,
        ``num_attention_heads``, ``vocab_size`` and, when present, ``num_key_value_heads``
        and ``head_dim``; a multimodal config's ``text_config`` is used when present.
        Keyword ``overrides`` replace any field (e.g. ``gated_mlp=False`` for GPT-style
        MLPs, or a value the config lacks).
        """
        config = getattr(config, "text_config", None) or config
        fields = {
            "hidden_size": "hidden_size",
            "num_layers": "num_hidden_layers",
            "intermediate_size": "intermediate_size",
            "num_heads": "num_attention_heads",
            "vocab_size": "vocab_size",
            "num_kv_heads": "num_key_value_heads",
            "head_dim": "head_dim",
        }
        optional = {"num_kv_heads", "head_dim"}
        kwargs: dict[str, Any] = {}
        for field_name, attr in fields.items():
            if field_name in overrides:
                continue
            value = getattr(config, attr, None)
            if value is None and field_name not in optional:
                raise ValueError(f"config has no {attr!r}; pass {field_name}=... to from_hf_config")
            kwargs[field_name] = value
        kwargs.update(overrides)
        return cls(**kwargs)

    @property
    def params_per_token(self) -> int:
        """Matmul weights each token passes through (all layers plus the LM head)."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        mlp = (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size
        return self.num_layers * (attention + mlp) + self.hidden_size * self.vocab_size

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token of the linear (length-independent) part."""
        return 2.0 * self.linear_training_factor * self.params_per_token

    @property
    def flops_per_token_pair(self) -> float:
        """Training FLOPs per attended (query, key) pair, all layers."""
        return 4.0 * self.attention_training_factor * self.num_layers * self.num_heads * self.head_dim

    def attention_flops(self, length: int) -> float:
        """Training FLOPs of the attention scores/values of one document."""
        pairs = length * (length + 1) / 2 if self.causal else float(length * length)
        return self.flops_per_token_pair * pairs

    def __call__(self, lengths: Sequence[int]) -> float:
        return sum(self.flops_per_token * n + self.attention_flops(n) for n in lengths)


@dataclass(frozen=True)
class FittedCost:
    """Measured cost: ``a + b * sum(lengths) + c * sum(length ** 2)`` (e.g. seconds).

    ``a`` is the fixed cost of a microbatch (for FSDP: the parameter gathers, kernel
    launches), ``b`` the per-token cost, ``c`` the attention's quadratic cost. The empty
    microbatch costs ``a``.
    """

    a: float
    b: float
    c: float

    def __post_init__(self) -> None:
        for name in ("a", "b", "c"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number, got {value!r}")

    def __call__(self, lengths: Sequence[int]) -> float:
        return self.a + self.b * sum(lengths) + self.c * sum(n * n for n in lengths)

    @classmethod
    def fit(cls, samples: Iterable[tuple[Sequence[int], float]]) -> FittedCost:
        """Least-squares fit on measured ``(document lengths, cost)`` pairs.

        The samples must vary both the total token count and how it is split into
        documents, or ``b`` and ``c`` cannot be told apart (``ValueError``). Noisy data
        can give negative coefficients; check the fit before using it.
        """
        import numpy as np

        rows, targets = [], []
        for k, (lengths, measured) in enumerate(samples):
            lengths = _check_lengths(lengths, name=f"samples[{k}] lengths")
            measured = float(measured)
            if not math.isfinite(measured):
                raise ValueError(f"samples[{k}] cost {measured!r} is not finite")
            rows.append([1.0, float(sum(lengths)), float(sum(n * n for n in lengths))])
            targets.append(measured)
        if len(rows) < 3:
            raise ValueError(f"need at least 3 samples to fit a, b, c, got {len(rows)}")
        design = np.asarray(rows)
        scale = np.abs(design).max(axis=0)
        scale[scale == 0] = 1.0  # an all-zero column makes the system rank-deficient below
        coef, _, rank, _ = np.linalg.lstsq(design / scale, np.asarray(targets), rcond=None)
        if rank < 3:
            raise ValueError("samples do not determine a, b, c: vary both the total tokens "
                             "and the document lengths")
        a, b, c = (coef / scale).tolist()
        return cls(a, b, c)


# --------------------------------------------------------------------------- partitioning


def karmarkar_karp(costs: Sequence[float], k: int) -> list[list[int]]:
    """Split items into ``k`` groups of near-equal total cost (largest differencing).

    The k-way Karmarkar-Karp method: every item starts as a partial partition of ``k``
    groups (the item alone, then ``k - 1`` empty groups). Repeatedly, the two partial
    partitions with the largest spread (max group sum - min group sum) are merged by
    pairing the heaviest group of one with the lightest of the other, and so on, until
    one partition is left. Ties are broken by creation order, so the result is
    deterministic. Returns ``k`` lists of item indices (ascending), heaviest group first;
    a group may be empty when there are fewer than ``k`` items.
    """
    costs = _check_costs(costs)
    _check_positive_int(k, "k")
    heap: list[tuple[float, int, list[float], list[list[int]]]] = []
    for i, c in enumerate(costs):
        # sums and groups are kept heaviest first
        heap.append((-c, i, [c] + [0.0] * (k - 1), [[i]] + [[] for _ in range(k - 1)]))
    if not heap:
        return [[] for _ in range(k)]
    heapq.heapify(heap)
    counter = len(costs)
    while len(heap) > 1:
        _, _, sums_a, groups_a = heapq.heappop(heap)
        _, _, sums_b, groups_b = heapq.heappop(heap)
        merged = sorted(
            ((sums_a[j] + sums_b[k - 1 - j], groups_a[j] + groups_b[k - 1 - j]) for j in range(k)),
            key=lambda pair: -pair[0],
        )
        sums = [s for s, _ in merged]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), counter, sums, [g for _, g in merged]))
        counter += 1
    return [sorted(group) for group in heap[0][3]]


def greedy_partition(costs: Sequence[float], k: int) -> list[list[int]]:
    """Longest-processing-time-first: heaviest item to the lightest group, repeatedly.

    Ties go to the lower item index and the lower group index. Returns ``k`` lists of
    item indices (ascending), in group order.
    """
    costs = _check_costs(costs)
    _check_positive_int(k, "k")
    groups: list[list[int]] = [[] for _ in range(k)]
    heap = [(0.0, g) for g in range(k)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (load + costs[i], g))
    return [sorted(group) for group in groups]


def optimal_partition(costs: Sequence[float], k: int) -> list[list[int]]:
    """Exact minimum of the largest group sum, by branch and bound (small inputs only).

    Exponential time: refuses more than 12 items. Meant for testing the heuristics.
    """
    costs = _check_costs(costs)
    _check_positive_int(k, "k")
    n = len(costs)
    if n > _OPTIMAL_PARTITION_MAX_ITEMS:
        raise ValueError(f"optimal_partition is exponential; got {n} items, "
                         f"at most {_OPTIMAL_PARTITION_MAX_ITEMS} allowed")
    order = sorted(range(n), key=lambda i: -costs[i])
    incumbent = greedy_partition(costs, k)
    best_max = max(sum(costs[i] for i in g) for g in incumbent)
    best_groups = incumbent
    loads = [0.0] * k
    assignment = [0] * n

    def search(pos: int) -> None:
        nonlocal best_max, best_groups
        if pos == n:
            current = max(loads)
            if current < best_max:
                best_max = current
                best_groups = [[] for _ in range(k)]
                for item, group in zip(order, assignment):
                    best_groups[group].append(item)
            return
        c = costs[order[pos]]
        tried = set()  # groups of equal load are interchangeable: try one of them
        for g in range(k):
            if loads[g] in tried or loads[g] + c >= best_max:
                continue
            tried.add(loads[g])
            loads[g] += c
            assignment[pos] = g
            search(pos + 1)
            loads[g] -= c

    search(0)
    return [sorted(group) for group in best_groups]


# --------------------------------------------------------------------------- packing


def _first_fit_decreasing_count(lengths: list[int], max_tokens: int) -> int:
    free: list[int] = []
    for length in sorted(lengths, reverse=True):
        for b, room in enumerate(free):
            if length <= room:
                free[b] -= length
                break
        else:
            free.append(max_tokens - length)
    return len(free)


def _place(order: list[int], lengths: list[int], num_bins: int, max_tokens: int,
           cost: CostModel) -> list[tuple[float, list[int]]]:
    """Each sample in ``order`` to the cheapest bin it fits in; a new bin if none."""
    items: list[list[int]] = [[] for _ in range(num_bins)]
    tokens = [0] * num_bins
    loads = [0.0] * num_bins
    for i in order:
        best = -1
        for b in range(len(items)):
            if tokens[b] + lengths[i] <= max_tokens and (
                best < 0 or (loads[b], tokens[b]) < (loads[best], tokens[best])
            ):
                best = b
        if best < 0:
            items.append([])
            tokens.append(0)
            loads.append(0.0)
            best = len(items) - 1
        items[best].append(i)
        tokens[best] += lengths[i]
        loads[best] = _eval_cost(cost, [lengths[j] for j in items[best]])
    return [(load, bin_items) for load, bin_items in zip(loads, items) if bin_items]


def pack(lengths: Sequence[int], max_tokens: int, cost: CostModel, *,
         multiple_of: int = 1) -> list[list[int]]:
    """Pack samples into microbatches of at most ``max_tokens`` tokens, balancing cost.

    Heuristic: the number of microbatches starts at the first-fit-decreasing bin count
    (the fewest a quick packing needs; fewer microbatches means fewer per-microbatch
    overheads), rounded up to a multiple of ``multiple_of``. Samples then go, by cost
    descending, to the currently cheapest microbatch with room for them (LPT scheduling
    under the token cap); a sample that fits nowhere opens a new microbatch, and if that
    broke the multiple, placement is redone with the count rounded up again. The count is
    never more than the number of samples, so the multiple is not reached when there are
    too few samples.

    Returns the microbatches (lists of indices into ``lengths``, in placement order),
    most expensive first. A sample longer than ``max_tokens`` raises ``ValueError``.
    """
    lengths = _check_lengths(lengths)
    _check_positive_int(max_tokens, "max_tokens")
    _check_positive_int(multiple_of, "multiple_of")
    _check_fits(lengths, max_tokens)
    n = len(lengths)
    if n == 0:
        return []
    sample_cost = [_eval_cost(cost, [length]) for length in lengths]
    order = sorted(range(n), key=lambda i: (-sample_cost[i], -lengths[i], i))

    def rounded(count: int) -> int:
        return min(n, -(-count // multiple_of) * multiple_of)

    target = rounded(_first_fit_decreasing_count(lengths, max_tokens))
    while True:
        bins = _place(order, lengths, target, max_tokens, cost)
        if len(bins) <= target or target == n:
            break
        target = rounded(len(bins))
    bins.sort(key=lambda load_items: -load_items[0])
    return [bin_items for _, bin_items in bins]


# --------------------------------------------------------------------------- plans


def lb_micro(lengths: Sequence[int], world_size: int, max_tokens: int, cost: CostModel) -> Plan:
    """LB-Micro: equal microbatch counts per rank, balanced per synchronous step.

    Samples are packed (:func:`pack`) into a multiple of ``world_size`` microbatches
    where there are enough samples (filling a step costs nothing extra). Sorted by cost
    descending, consecutive runs of ``world_size`` microbatches form the steps, which
    minimises the sum over steps of the step's most expensive microbatch for these
    microbatches. Within a step, the most expensive microbatch goes to the rank with the
    smallest running total, so rank totals stay even too. When the count is not a
    multiple of ``world_size`` (fewer samples than ranks, or the packer needed extra
    microbatches), the last step is padded with empty microbatches ``[]``: that rank
    has no data for the step but must still take part in it (e.g. a dummy step, as
    per-layer FSDP collectives need every rank).

    Returns, per rank, its microbatches (lists of indices into ``lengths``); every rank
    gets the same number.
    """
    lengths = _check_lengths(lengths)
    _check_positive_int(world_size, "world_size")
    microbatches = pack(lengths, max_tokens, cost, multiple_of=world_size)  # most expensive first
    mb_cost = [_eval_cost(cost, [lengths[i] for i in mb]) for mb in microbatches]
    num_steps = -(-len(microbatches) // world_size)
    order: list[int | None] = list(range(len(microbatches)))
    order += [None] * (num_steps * world_size - len(order))
    plan: Plan = [[] for _ in range(world_size)]
    totals = [0.0] * world_size
    for step in range(num_steps):
        ranks = sorted(range(world_size), key=lambda r: (totals[r], r))
        for r, j in zip(ranks, order[step * world_size:(step + 1) * world_size]):
            if j is None:
                plan[r].append([])
            else:
                plan[r].append(microbatches[j])
                totals[r] += mb_cost[j]
    return plan


def lb_mini(lengths: Sequence[int], world_size: int, max_tokens: int, cost: CostModel) -> Plan:
    """LB-Mini: balance each rank's total cost over the minibatch; counts may differ.

    The *samples* are partitioned over the ranks with :func:`karmarkar_karp` by their
    marginal cost (``cost([n]) - cost([])``, clamped at 0: a sample's cost without the
    fixed per-microbatch part), then each rank packs its share with :func:`pack`.
    Partitioning samples rather than ready-made microbatches balances at a much finer
    grain: a rank's total is the sum of its samples' costs plus one fixed cost per
    microbatch, whatever the packing. (Packing first and partitioning the microbatches
    left the heaviest rank often worse than LB-Micro's on long-tailed lengths.) A rank
    may get no microbatch at all (fewer samples than ranks). The heaviest share goes to
    rank 0; each rank's microbatches are listed most expensive first.

    Returns, per rank, its microbatches (lists of indices into ``lengths``).
    """
    lengths = _check_lengths(lengths)
    _check_positive_int(world_size, "world_size")
    _check_positive_int(max_tokens, "max_tokens")
    _check_fits(lengths, max_tokens)
    fixed = _eval_cost(cost, [])
    marginal = [max(0.0, _eval_cost(cost, [length]) - fixed) for length in lengths]
    plan: Plan = []
    for share in karmarkar_karp(marginal, world_size):
        microbatches = pack([lengths[i] for i in share], max_tokens, cost)
        plan.append([[share[i] for i in mb] for mb in microbatches])
    return plan


def plan_stats(plan: Plan, lengths: Sequence[int], cost: CostModel) -> dict[str, Any]:
    """Predicted times of a plan under synchronous and decoupled execution.

    Empty microbatches (padding) cost 0: the rank idles. Step ``j`` is microbatch ``j``
    of every rank (a rank without one idles). Keys:

    * ``per_rank_cost``, ``per_rank_tokens``, ``per_rank_microbatches``: per-rank lists;
    * ``num_steps``: the largest microbatch count of any rank;
    * ``sync_time``: ``sum over steps of max over ranks`` of the step's cost, the time
      when every step synchronises all ranks (per-layer collectives);
    * ``decoupled_time``: ``max over ranks`` of the rank's total, the time with one
      synchronisation per minibatch;
    * ``ideal_speedup``: ``sync_time / decoupled_time`` (>= 1; 1 for an empty plan);
    * ``bubble_rate_sync``: ``1 - total / (world_size * sync_time)``, the idle fraction
      of synchronous execution; ``bubble_rate_decoupled``: the same for decoupled.
    """
    lengths = _check_lengths(lengths)
    mb_costs = [[_eval_cost(cost, [lengths[i] for i in mb]) if mb else 0.0 for mb in rank_plan]
                for rank_plan in plan]
    per_rank_cost = [sum(costs) for costs in mb_costs]
    num_steps = max((len(costs) for costs in mb_costs), default=0)
    sync_time = sum(max(costs[j] if j < len(costs) else 0.0 for costs in mb_costs)
                    for j in range(num_steps))
    decoupled_time = max(per_rank_cost, default=0.0)
    total = sum(per_rank_cost)
    world = len(plan)
    return {
        "per_rank_cost": per_rank_cost,
        "per_rank_tokens": [sum(lengths[i] for mb in rank_plan for i in mb) for rank_plan in plan],
        "per_rank_microbatches": [len(rank_plan) for rank_plan in plan],
        "num_steps": num_steps,
        "sync_time": sync_time,
        "decoupled_time": decoupled_time,
        "ideal_speedup": sync_time / decoupled_time if decoupled_time > 0 else 1.0,
        "bubble_rate_sync": 1.0 - total / (world * sync_time) if sync_time > 0 else 0.0,
        "bubble_rate_decoupled": 1.0 - total / (world * decoupled_time) if decoupled_time > 0 else 0.0,
    }


def microbatches(lengths: Sequence[int], world_size: int, rank: int, max_tokens: int,
                 cost: CostModel, mode: str = "lb_mini") -> list[list[int]]:
    """This rank's microbatches of one minibatch: lists of indices into ``lengths``.

    ``lengths`` are the token counts of the whole minibatch (every rank passes the same
    list, so every rank computes the same plan without communicating). ``mode="lb_mini"``
    (decoupled mode: counts may differ per rank, zero included) or ``"lb_micro"`` (exact
    mode / other backends: every rank gets the same count; an empty list is a padding
    microbatch that must still run, e.g. as a zero-weight dummy)::

        for micro in odc.balance.microbatches(lengths, world, rank, 65536, cost):
            loss_fn(model(pack([samples[i] for i in micro]))).backward()
        odc.sync(model)
    """
    planner = _check_mode(mode)
    return planner(lengths, world_size, max_tokens, cost)[_check_rank(rank, world_size)]


# --------------------------------------------------------------------------- data loading

_PLANNERS = {"lb_mini": lb_mini, "lb_micro": lb_micro}


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
    :class:`MinibatchDataset` (see the module docstring).
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


# --------------------------------------------------------------------------- dynamic balancing


def _odc_backend_of(group: Any) -> tuple[Any, str]:
    """The odc backend object of ``group`` and its device type (CUDA first, else CPU)."""
    import torch.distributed as dist

    from . import _C

    if not dist.is_initialized():
        raise RuntimeError("dynamic balancing needs an initialised process group on odc")
    pg = group if group is not None else dist.group.WORLD
    for device_type in ("cuda", "cpu"):
        try:
            backend = pg._get_backend(torch.device(device_type))
        except (RuntimeError, ValueError):
            continue
        if isinstance(backend, _C.OdcBackend):
            return backend, device_type
    raise ValueError("dynamic balancing needs a group whose backend is odc (e.g. init_process_group"
                     "(\"cpu:gloo,cuda:odc\")); this group has none: its ranks cannot share a counter")


def lb_mini_weighted(lengths: Sequence[int], slowdowns: Sequence[float], max_tokens: int,
                     cost: CostModel) -> Plan:
    """LB-Mini for ranks of unequal speed: rank ``r`` takes ``slowdowns[r]`` seconds per unit of
    cost, and each rank's *time* (its total cost times its slowdown) is balanced.

    Equal speeds (within 3 %) give :func:`lb_mini` (Karmarkar-Karp; the heaviest share to
    rank 0). Otherwise samples go, by marginal cost descending, to the rank whose time stays
    smallest with them (ties to the lower rank), and each rank packs its share with
    :func:`pack`. Returns, per rank ``r`` (in rank order), its microbatches.
    """
    lengths = _check_lengths(lengths)
    factors = [float(f) for f in slowdowns]
    if not factors or any(not math.isfinite(f) or f <= 0 for f in factors):
        raise ValueError(f"slowdowns must be positive numbers, one per rank, got {list(slowdowns)!r}")
    world_size = len(factors)
    if max(factors) <= 1.03 * min(factors):
        return lb_mini(lengths, world_size, max_tokens, cost)
    _check_positive_int(max_tokens, "max_tokens")
    _check_fits(lengths, max_tokens)
    fixed = _eval_cost(cost, [])
    marginal = [max(0.0, _eval_cost(cost, [length]) - fixed) for length in lengths]
    loads = [0.0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-marginal[i], i)):
        r = min(range(world_size), key=lambda r: ((loads[r] + marginal[i]) * factors[r], r))
        shares[r].append(i)
        loads[r] += marginal[i]
    plan: Plan = []
    for share in shares:
        microbatches = pack([lengths[i] for i in share], max_tokens, cost)
        plan.append([[share[i] for i in mb] for mb in microbatches])
    return plan


class DynamicBalancer:
    """Shares each minibatch's work among the ranks of ``group`` as they become free.

    Every round (one :meth:`minibatch` call per minibatch, on every rank with the same
    arguments) starts from a plan: :func:`lb_mini_weighted` with the ranks' speeds measured
    in earlier rounds (equal speeds: plain LB-Mini). Rank ``r``'s microbatches form its
    queue, most expensive first; its last microbatch is kept as separate documents at the
    back of the queue. A rank takes work from the front of its own queue (the last
    microbatch's documents still there are trained together, as one microbatch); a rank
    whose queue is empty takes single items from the back of the queue with the most items
    left. Each take is an atomic fetch-add on a counter in the group's store (one per
    take from one's own queue, two per take from another's), so each item is trained by
    exactly one rank: a straggler (a throttled GPU, a longer microbatch than the cost model
    said) gives its tail to the ranks that are free, and a rank that stays slow gets a
    smaller share in the next plans.

    ``adapt=False`` keeps every plan at equal speeds (plain LB-Mini plus taking from others).
    Speeds: each rank publishes its seconds per unit of cost of a round when the next one
    starts; plans use the rounds up to two back (published before the last ``odc.sync``, so
    no rank waits for them), smoothed with weight ``smoothing`` on the newest.

    Rules every rank must follow, since rounds are matched by their order:

    * every rank of ``group`` makes the same balancers in the same order (or passes the
      same ``name``) and calls :meth:`minibatch` the same number of times with the same
      lengths, token cap and cost model;
    * each round ends with a synchronisation of the whole group (``odc.sync`` in decoupled
      mode): rank 0 deletes a round's keys from the store three rounds later.

    On CUDA a rank takes work when its GPU is free enough: before taking, it waits until the
    GPU has finished all but ``ahead`` of the microbatches it handed out (``ahead=1``: the
    next one is taken while the GPU runs the current one, so the GPU does not idle for the
    host, and a rank holds at most one microbatch it has not started). Without the wait the
    host, which runs ahead of the GPU, would take work for a GPU that is still busy.
    """

    _instances: dict[str, int] = {}

    def __init__(self, group: Any = None, *, name: str | None = None, ahead: int = 1,
                 device: torch.device | str | None = None, adapt: bool = True,
                 smoothing: float = 0.5) -> None:
        import torch.distributed as dist

        self._backend, device_type = _odc_backend_of(group)
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
            raise ValueError(f"ahead must be a non-negative integer, got {ahead!r}")
        self.ahead = ahead
        if not (isinstance(smoothing, (int, float)) and 0 < smoothing <= 1):
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.smoothing = float(smoothing)
        self.adapt = bool(adapt)
        if name is None:  # the n-th balancer of this group, the same on every rank
            key = (group if group is not None else dist.group.WORLD).group_name
            count = DynamicBalancer._instances.get(key, 0)
            DynamicBalancer._instances[key] = count + 1
            name = f"balancer{count}"
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"name must be a non-empty string without '/', got {name!r}")
        self.name = name
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if device_type == "cuda" and torch.cuda.is_available() else torch.device("cpu"))
        self.device = torch.device(device)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.round = 0
        #: per rank, smoothed seconds per unit of cost (None until measured)
        self.speeds: list[float | None] = [None] * self.world_size
        #: per round: the slowdowns its plan used, and what this rank took ("own"/"taken")
        self.history: list[dict[str, Any]] = []
        self._last: MinibatchClaims | None = None

    def _key(self, round_: int, what: str) -> str:
        return f"{self.name}/{round_}/{what}"

    def slowdowns(self) -> list[float]:
        """Each rank's time per unit of cost relative to the fastest (1.0 until measured)."""
        known = [s for s in self.speeds if s is not None]
        if not self.adapt or len(known) < self.world_size:
            return [1.0] * self.world_size
        fastest = min(known)
        return [s / fastest for s in known] if fastest > 0 else [1.0] * self.world_size

    def _between_rounds(self, round_: int) -> None:
        """Publish the last round's measurement; learn the one of two rounds back; drop old keys."""
        if round_ >= 1:
            busy, cost = self._last.measure() if self._last is not None else (0.0, 0.0)
            self._backend.publish(self._key(round_ - 1, f"speed{self.rank}"), f"{busy!r} {cost!r}")
        if round_ >= 2 and self.adapt:
            for r in range(self.world_size):
                busy, cost = (float(x) for x in self._backend.lookup(self._key(round_ - 2, f"speed{r}")).split())
                if cost > 0 and busy > 0:
                    new = busy / cost
                    old = self.speeds[r]
                    self.speeds[r] = new if old is None else old + self.smoothing * (new - old)
        if round_ >= 3 and self.rank == 0:
            for r in range(self.world_size):
                for what in (f"taken{r}", f"back{r}", f"speed{r}"):
                    self._backend.forget(self._key(round_ - 3, what))

    def minibatch(self, lengths: Sequence[int], max_tokens: int, cost: CostModel,
                  indices: Sequence[int] | None = None) -> MinibatchClaims:
        """Start the next round over a minibatch of samples with these token ``lengths``
        (identical on every rank); iterate the result for this rank's microbatches: lists of
        positions in ``lengths``, or of ``indices[position]`` when ``indices`` is given."""
        lengths = _check_lengths(lengths)
        if indices is not None and len(indices) != len(lengths):
            raise ValueError(f"indices has {len(indices)} entries for {len(lengths)} lengths")
        round_ = self.round
        self.round += 1
        self._between_rounds(round_)
        slowdowns = self.slowdowns()
        plan = lb_mini_weighted(lengths, slowdowns, max_tokens, cost)
        if indices is not None:
            plan = [[[indices[i] for i in mb] for mb in rank_plan] for rank_plan in plan]
        record: dict[str, Any] = {"slowdowns": slowdowns, "own": [], "taken": []}
        self.history.append(record)
        lookup = dict(zip(indices, lengths)) if indices is not None else dict(enumerate(lengths))
        claims = MinibatchClaims(self, round_, plan, lambda mb: _eval_cost(cost, [lookup[i] for i in mb]),
                                 record, sum(lengths))
        self._last = claims
        return claims


class MinibatchClaims:
    """This rank's share of one minibatch under dynamic balancing (:class:`DynamicBalancer`).

    Iterating it yields this rank's microbatches (lists of sample or dataset indices), each
    taken only when the loop asks for it; it can be iterated once. ``plan`` is the round's
    starting plan (every rank's queue), ``num_tokens`` the minibatch's token count (normalise
    the loss by it: the ranks' shares differ).
    """

    def __init__(self, balancer: DynamicBalancer, round_: int, plan: Plan,
                 cost_of: Callable[[list[int]], float], record: dict[str, Any], num_tokens: int) -> None:
        self._balancer = balancer
        self._round = round_
        self.plan = plan
        self.num_tokens = num_tokens
        self._cost_of = cost_of
        self._record = record
        # per rank: queue items (lists of indices) and their group (a microbatch's documents
        # at the back share one group and go together when their owner takes them)
        self._items: list[list[list[int]]] = []
        self._groups: list[list[int]] = []
        for rank_plan in plan:
            items, groups = [], []
            for g, mb in enumerate(rank_plan):
                if g == len(rank_plan) - 1 and len(mb) > 1:
                    items += [[i] for i in mb]
                    groups += [g] * len(mb)
                else:
                    items.append(list(mb))
                    groups.append(g)
            self._items.append(items)
            self._groups.append(groups)
        self._front = 0  # next item of this rank's own queue (only this rank takes from the front)
        self._own_done = False
        self._empty: set[int] = set()  # queues known to be exhausted
        self._done = False
        self._marks: list[Any] = []  # start of each microbatch handed out, then the end
        self._cost = 0.0

    def __iter__(self) -> MinibatchClaims:
        return self

    # --- timing: when to take, and this rank's speed

    def _mark(self) -> Any:
        if self._balancer.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self._balancer.device))
            return event
        import time

        return time.perf_counter()

    def _wait_for_device(self) -> None:
        """Mark the end of the last microbatch's work; block until the GPU has at most
        ``ahead`` handed-out microbatches left to run."""
        if not self._marks:
            return
        self._marks.append(self._mark())
        ahead = self._balancer.ahead
        handed = len(self._marks) - 1  # microbatches handed out so far
        if self._balancer.device.type == "cuda" and handed >= 1:
            # mark k (k >= 1) ends microbatch k - 1; wait for the end of microbatch handed - 1 - ahead
            k = handed - ahead
            if k >= 1:
                self._marks[k].synchronize()

    def measure(self) -> tuple[float, float]:
        """(seconds this rank's microbatches took, their total cost): from the first one's
        start to the last one's end."""
        if len(self._marks) < 2 or self._cost <= 0:
            return 0.0, 0.0
        first, last = self._marks[0], self._marks[-1]
        if self._balancer.device.type == "cuda":
            last.synchronize()
            return first.elapsed_time(last) / 1e3, self._cost
        return last - first, self._cost

    # --- taking work

    def _take(self, key: str, amount: int) -> int:
        return self._balancer._backend.claim(self._balancer._key(self._round, key), amount)

    def _own(self) -> list[int] | None:
        rank = self._balancer.rank
        items, groups = self._items[rank], self._groups[rank]
        f = self._front
        if f >= len(items):
            return None
        k = 1
        while f + k < len(items) and groups[f + k] == groups[f]:
            k += 1
        taken = self._take(f"taken{rank}", k)
        granted = max(0, min(k, len(items) - taken))
        if granted == 0:
            return None
        self._front += granted
        return [i for item in items[f:f + granted] for i in item]

    def _steal(self) -> list[int] | None:
        me = self._balancer.rank
        while True:
            left = []
            for v in range(self._balancer.world_size):
                if v == me or v in self._empty:
                    continue
                remaining = len(self._items[v]) - self._take(f"taken{v}", 0)
                if remaining > 0:
                    left.append((remaining, -v))
                else:
                    self._empty.add(v)
            if not left:
                return None
            victim = -max(left)[1]
            if self._take(f"taken{victim}", 1) >= len(self._items[victim]):
                self._empty.add(victim)
                continue
            back = self._take(f"back{victim}", 1)
            return list(self._items[victim][len(self._items[victim]) - 1 - back])

    def __next__(self) -> list[int]:
        if self._done:
            raise StopIteration
        self._wait_for_device()
        mb = None
        if not self._own_done:
            mb = self._own()
            if mb is None:
                self._own_done = True
            else:
                self._record["own"].append(mb)
        if mb is None:
            mb = self._steal()
            if mb is not None:
                self._record["taken"].append(mb)
        if mb is None:
            self._done = True
            raise StopIteration
        if not self._marks:
            self._marks.append(self._mark())  # the start of this rank's first microbatch
        self._cost += self._cost_of(mb)
        return mb


class DynamicBatchSampler(_Minibatches, Sampler[MinibatchClaims]):
    """Dynamic balancing over a map-style dataset: yields one :class:`MinibatchClaims` per
    minibatch; iterating that claims this rank's microbatches (lists of dataset indices).

    Minibatches are cut as :class:`BalancedBatchSampler` cuts them (same shuffle for the
    same ``seed`` and epoch) and shared as :class:`DynamicBalancer` describes (``group``,
    ``name``, ``ahead``, ``device`` and ``adapt`` are its arguments). For decoupled mode
    only: exact-mode FSDP needs every rank to run the same number of microbatches. Each
    minibatch must end with ``odc.sync`` (see the module docstring for the loop). With a
    DataLoader, make one per minibatch that loads in the training loop::

        loader = DataLoader(MicrobatchDataset(dataset, collate_fn), sampler=claims,
                            batch_size=None)   # per minibatch; num_workers=0: no claims ahead

    DataLoader workers would fetch (and so claim) ``num_workers * prefetch_factor``
    microbatches ahead and hoard work; loading in the training loop keeps the claims on
    demand, and with ``ahead=1`` the GPU runs the current microbatch while the next loads.
    """

    def __init__(self, lengths: Sequence[int], max_tokens: int, minibatch_size: int,
                 cost: CostModel, *, group: Any = None, name: str | None = None, ahead: int = 1,
                 device: torch.device | str | None = None, adapt: bool = True, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False) -> None:
        self._init_minibatches(lengths, max_tokens, minibatch_size, cost, seed, shuffle, drop_last)
        self.balancer = DynamicBalancer(group, name=name, ahead=ahead, device=device, adapt=adapt)

    def __iter__(self) -> Iterator[MinibatchClaims]:
        for index in range(len(self)):
            indices = self.minibatch_indices(index)
            yield self.balancer.minibatch([self.lengths[i] for i in indices], self.max_tokens,
                                          self.cost, indices=indices)


class MicrobatchDataset(Dataset):
    """Map-style view whose items are microbatches: ``view[indices] -> collate_fn(samples)``.

    The DataLoader companion of :class:`MinibatchClaims` (``sampler=claims``, ``batch_size=None``).
    """

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any] = default_collate) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn

    def __getitem__(self, indices: Sequence[int]) -> Any:
        return self.collate_fn([self.dataset[i] for i in indices])


def balance_bound(microbatch_costs: Sequence[float], slowdowns: Sequence[float]) -> float:
    """The perfect-balance bound of one minibatch: no schedule of these microbatches on ranks
    with these ``slowdowns`` (a rank's time per unit of cost; 1 for all ranks when they are
    equal) finishes sooner than ``max(sum(costs) / sum(1 / slowdown), max(costs) *
    min(slowdowns))``: the work spread perfectly by speed, or the largest microbatch alone
    on the fastest rank."""
    costs = _check_costs(microbatch_costs)
    factors = [float(f) for f in slowdowns]
    if not factors or any(not math.isfinite(f) or f <= 0 for f in factors):
        raise ValueError(f"slowdowns must be positive numbers, one per rank, got {list(slowdowns)!r}")
    if not costs:
        return 0.0
    return max(sum(costs) / sum(1.0 / f for f in factors), max(costs) * min(factors))
