"""The tests' own launcher (dist_utils.run_distributed): a rank that misses the deadline is
reported with its Python stacks, so a hang in any distributed test says where it is."""
from __future__ import annotations

import time

import pytest

from dist_utils import run_distributed


def _rank1_stuck(rank, world):
    if rank == 1:
        while True:  # a host wait that never ends (a peer that never answers)
            time.sleep(0.1)
    return rank


def test_a_hung_rank_is_reported_with_its_stack():
    with pytest.raises(AssertionError) as e:
        run_distributed(_rank1_stuck, 2, backend="gloo", deadline_s=5)
    text = str(e.value)
    assert "missing ranks [1]" in text, text
    assert "rank 1, still running at the deadline" in text and "_rank1_stuck" in text, text
    assert "rank 0, still running" not in text, text
