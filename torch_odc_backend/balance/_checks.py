"""Argument checks shared by the balancing modules: each raises ``ValueError`` naming the bad value."""
from __future__ import annotations

import math
import operator
from typing import Any, Iterable, Sequence


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

