"""Plans: which microbatches each data-parallel rank trains in one minibatch. **LB-Micro**
(:func:`lb_micro`) gives every rank the same number of microbatches and balances each
synchronous step (microbatch ``j`` of all ranks, as per-layer FSDP collectives force), so the
minibatch takes ``sum over steps of the slowest rank``; **LB-Mini** (:func:`lb_mini`, and
:func:`lb_mini_weighted` for ranks of unequal speed) lets counts differ (zero included) and
balances each rank's total, for on-demand communication where ranks synchronise once per
minibatch and the minibatch takes ``max over ranks of the rank's total``. :func:`plan_stats`
predicts both times for any plan, :func:`balance_bound` the best any schedule can do."""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from ._checks import _check_costs, _check_fits, _check_lengths, _check_positive_int, _check_rank
from .cost import CostModel, _eval_cost
from .partition import karmarkar_karp, pack

#: A plan: per rank, a list of microbatches, each a list of sample indices.
Plan = list[list[list[int]]]


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


_PLANNERS = {"lb_mini": lb_mini, "lb_micro": lb_micro}


def _check_mode(mode: Any) -> Callable[..., Plan]:
    """The planner of ``mode`` ("lb_mini" or "lb_micro")."""
    if mode not in _PLANNERS:
        raise ValueError(f"mode must be one of {sorted(_PLANNERS)}, got {mode!r}")
    return _PLANNERS[mode]


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
