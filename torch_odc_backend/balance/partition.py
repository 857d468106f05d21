"""Splitting items into groups: multi-way number partitioning (:func:`karmarkar_karp`,
:func:`greedy_partition`, and the brute-force :func:`optimal_partition` for checking them on
small cases) and token-capped packing of samples into microbatches of balanced cost
(:func:`pack`). Every function is deterministic."""
from __future__ import annotations

import heapq
from typing import Sequence

from ._checks import _check_costs, _check_fits, _check_lengths, _check_positive_int
from .cost import CostModel, _eval_cost

_OPTIMAL_PARTITION_MAX_ITEMS = 12


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
