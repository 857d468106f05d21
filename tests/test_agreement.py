"""Choices every rank of a group must make alike.

Two kinds: the ODC_* knobs that change what a rank writes where its peers read (checked
through the store when a channel is set up: one rank set differently is an error on every
rank at once, naming the knob and both values), and the decisions taken from where the ranks
are (computed from the group's placement, which every rank knows alike: a test on layouts
where ranks see different local facts, e.g. 3 ranks on 2 GPUs).
Knobs that only change how a rank runs its own steps (engine thresholds, block counts, stream
memory operations) may differ; on GPUs test_collectives.py runs such a mix."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed

WORLD, ODD = 3, 2
TIMEOUT_S = 30.0
# knob: (what rank ODD sets, what the others keep: their default or a value)
KNOBS = {
    "ODC_RING_SLOTS": ("8", "4"),
    "ODC_CHUNK_BYTES": ("64K", "1048576"),
    "ODC_MATCH_CHECK": ("0", "1"),
    "ODC_STAGED_AG_PUSH": ("1", "0"),
    "ODC_AG_PUSH": ("1", "auto"),
    "ODC_SELF_SERVE": ("1", "auto"),
    "ODC_POOL_BYTES": ("8M", str(64 << 20)),
}


def _disagree_worker(rank, world):
    out = {}
    for knob, (odd, _) in KNOBS.items():
        if rank == ODD:
            os.environ[knob] = odd
        g = dist.new_group(list(range(world)))  # its options are read now
        os.environ.pop(knob, None)
        t0 = time.monotonic()
        try:
            y = torch.empty(world * 4)
            dist.all_gather_into_tensor(y, torch.ones(4), group=g)
            out[knob] = None
        except Exception as exc:  # noqa: BLE001
            out[knob] = (type(exc).__name__, str(exc), time.monotonic() - t0)
    # a group whose ranks agree still works, and so does an engine knob set on one rank only
    if rank == ODD:
        os.environ["ODC_REDUCE_BLOCKS"] = "3"
    g = dist.new_group(list(range(world)))
    os.environ.pop("ODC_REDUCE_BLOCKS", None)
    y = torch.empty(world * 2)
    dist.all_gather_into_tensor(y, torch.full((2,), float(rank)), group=g)
    out["agreed"] = y.tolist()
    return out


@pytest.fixture(scope="module")
def disagreed():
    return run_distributed(_disagree_worker, WORLD, timeout_s=TIMEOUT_S, deadline_s=180)


@pytest.mark.parametrize("knob", sorted(KNOBS))
def test_a_knob_set_differently_fails_every_rank_at_once(disagreed, knob):
    odd, others = KNOBS[knob]
    for rank in range(WORLD):
        got = disagreed[rank][knob]
        assert got is not None, f"rank {rank}: {knob} set differently on rank {ODD} went unnoticed"
        kind, msg, took = got
        assert kind == "ValueError", (rank, kind, msg)
        peer = ODD if rank != ODD else 0
        mine, theirs = (odd, others) if rank == ODD else (others, odd)
        want_mine = f"this rank ({rank}) has {knob}="
        assert want_mine in msg and f"rank {peer} has {knob}=" in msg, (rank, msg)
        if knob not in ("ODC_CHUNK_BYTES", "ODC_POOL_BYTES"):  # (those are named in bytes)
            assert f"{want_mine}{mine}," in msg and f"rank {peer} has {knob}={theirs}." in msg, (rank, msg)
        assert took < TIMEOUT_S / 3, f"rank {rank}: {took:.1f}s (a timeout?)"


def test_groups_that_agree_work_and_engine_knobs_may_differ(disagreed):
    want = [float(r) for r in range(WORLD) for _ in range(2)]
    for rank in range(WORLD):
        assert disagreed[rank]["agreed"] == want, (rank, disagreed[rank]["agreed"])


# ---- decisions from where the ranks are (no GPU needed: the placement is given)

LAYOUTS = {  # one GPU label per rank
    "3 ranks on 2 GPUs": ["a", "b", "a"],
    "4 ranks on 2 GPUs": ["a", "b", "a", "b"],
    "3 ranks, two on the first GPU": ["a", "a", "b"],
    "a GPU each": ["a", "b", "c", "d"],
    "one GPU": ["a", "a"],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("ag_push", ["auto", "1", "0"])
def test_placement_choices_are_the_groups(layout, ag_push, monkeypatch):
    from torch_odc_backend import _C, config

    gpus = LAYOUTS[layout]
    monkeypatch.setenv("ODC_AG_PUSH", ag_push)
    opts = config.knobs()
    per_rank = [_C._placement_choices(gpus, r, opts) for r in range(len(gpus))]
    shared = {(c["shares_device"], c["push_all_gather"]) for c in per_rank}
    assert len(shared) == 1, f"{layout}: ranks decide differently: {per_rank}"
    shares, push = shared.pop()
    assert shares == (len(set(gpus)) < len(gpus)), (layout, per_rank)
    own = len(set(gpus)) == len(gpus)
    assert push == (ag_push == "1" or (ag_push == "auto" and own and len(gpus) >= 3)), (layout, per_rank)
    # the one local fact: how many ranks share this rank's GPU (sizes its own kernels only)
    assert [c["ranks_on_gpu"] for c in per_rank] == [gpus.count(g) for g in gpus]
