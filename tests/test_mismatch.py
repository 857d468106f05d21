"""Ranks that disagree about a collective (dtype, size, reduce op) get a clear error on
every rank involved, naming both sides, instead of wrong data (CPU; the GPU version is in
tests/test_collectives.py, its CUDA part).

One spawned job runs every case, each on a fresh group (a mismatch leaves its group
unusable, as a timeout does); rank ODD is the one that disagrees, so ranks that agree with
each other must still see it."""
from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed, run_once
from test_collectives import SMALL_RING

WORLD, ODD = 3, 2
F32, BF16 = torch.float32, torch.bfloat16
TIMEOUT_S = 30.0  # a mismatch must be found long before the group's timeout
SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG


def _ag(n, dtype):
    return lambda g, dev: dist.all_gather_into_tensor(
        torch.empty(WORLD * n, dtype=dtype, device=dev), torch.ones(n, dtype=dtype, device=dev), group=g)


def _rs(n, dtype, op):
    return lambda g, dev: dist.reduce_scatter_tensor(
        torch.empty(n, dtype=dtype, device=dev), torch.ones(WORLD * n, dtype=dtype, device=dev),
        op=op, group=g)


def _coalesced_ag(second):
    def call(g, dev):
        with dist.distributed_c10d._coalescing_manager(group=g):
            dist.all_gather_into_tensor(torch.empty(WORLD * 4, device=dev), torch.ones(4, device=dev), group=g)
            dist.all_gather_into_tensor(torch.empty(WORLD * second, device=dev),
                                        torch.ones(second, device=dev), group=g)
    return call


# name: (what the agreeing ranks call, what rank ODD calls, both descriptors' texts; without the
# collective's name, which on GPUs names its path too: "all_gather (direct)")
CASES = {
    "ag_dtype": (_ag(16, F32), _ag(32, BF16),
                 ("of 64 bytes per rank (float32)", "of 64 bytes per rank (bfloat16)")),
    "ag_size": (_ag(8, F32), _ag(16, F32),
                ("of 32 bytes per rank (float32)", "of 64 bytes per rank (float32)")),
    "ag_empty": (_ag(8, F32), _ag(0, F32),
                 ("of 32 bytes per rank", "of 0 bytes per rank")),
    # several chunks of the ring per call: found at the first
    "ag_size_many_chunks": (_ag(40_000, F32), _ag(50_000, F32),
                            ("160000 bytes per rank", "200000 bytes per rank")),
    "rs_op": (_rs(8, F32, SUM), _rs(8, F32, AVG),
              ("of 32 bytes per rank (float32, SUM)",
               "of 32 bytes per rank (float32, AVG)")),
    "rs_dtype": (_rs(16, F32, SUM), _rs(32, BF16, SUM),
                 ("(float32, SUM)", "(bfloat16, SUM)")),
    "rs_size": (_rs(8, BF16, AVG), _rs(9, BF16, AVG),
                ("16 bytes per rank (bfloat16, AVG)", "18 bytes per rank (bfloat16, AVG)")),
    "coalesced_second": (_coalesced_ag(4), _coalesced_ag(6),
                         ("of 16 bytes per rank", "of 24 bytes per rank")),
}


def _different_ops(rank_calls_rs):
    return lambda g, dev: (_rs(8, F32, SUM) if rank_calls_rs else _ag(8, F32))(g, dev)


# Different collectives at the same point (rank ODD reduce-scatters while the others
# all-gather): each side waits for data the other never sends, so only the peers'
# announcements of what they called can tell, long before the group's timeout.
# (Knobs that change a collective's form, such as ODC_STAGED_AG_PUSH, are checked when a group's
# channel is set up: tests/test_agreement.py.)
DIFFERENT = {"ag_vs_rs": (_different_ops(False), _different_ops(True))}


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run_cases(rank, world, dev):
    """Each case on a fresh group: the error (on GPU raised by the group's next call: the
    kernels find the mismatch), how long it took, and what a further call raises."""
    out = {}
    cases = {**{k: v[:2] for k, v in CASES.items()}, **DIFFERENT}
    for name, (agreed, odd) in cases.items():
        g = dist.new_group(list(range(world)))
        t0 = time.monotonic()
        try:
            (odd if rank == ODD else agreed)(g, dev)
            _sync(dev)
            _ag(4, F32)(g, dev)  # on GPU the failure is recorded on the device: this raises it
            out[name] = dict(error=None)
        except Exception as exc:  # noqa: BLE001
            out[name] = dict(error=str(exc), type=type(exc).__name__,
                             is_runtime=isinstance(exc, RuntimeError))
        out[name]["elapsed"] = time.monotonic() - t0
        try:  # the group stays unusable, with the same message
            _ag(4, F32)(g, dev)
            out[name]["after"] = None
        except Exception as exc:  # noqa: BLE001
            out[name]["after"] = str(exc)
    # The same disagreement with ODC_MATCH_CHECK=0 (read when a group is created) goes
    # unnoticed: the data are garbage, which is what the check exists for.
    os.environ["ODC_MATCH_CHECK"] = "0"
    unchecked = dist.new_group(list(range(world)))
    os.environ.pop("ODC_MATCH_CHECK")
    try:
        (CASES["ag_dtype"][1] if rank == ODD else CASES["ag_dtype"][0])(unchecked, dev)
        _sync(dev)
        out["unchecked"] = None
    except Exception as exc:  # noqa: BLE001
        out["unchecked"] = str(exc)
    # Groups that agree were not disturbed by the others' failures.
    x = torch.arange(5, dtype=F32, device=dev) + 10 * rank
    y = torch.empty(world * 5, device=dev)
    dist.all_gather_into_tensor(y, x)
    out["world_after"] = y.tolist()
    return out


def _worker(rank, world):
    return run_cases(rank, world, torch.device("cpu"))


@pytest.fixture(scope="module")
def run():
    return run_once(lambda: run_distributed(_worker, WORLD, env=SMALL_RING, timeout_s=TIMEOUT_S,
                                            deadline_s=240))


@pytest.mark.parametrize("case", sorted(CASES))
def test_mismatch_raises_on_every_rank_naming_both_sides(run, case):
    assert_reported(run(), case)


def assert_reported(res, case):
    agreed_text, odd_text = CASES[case][2]
    named_both = 0
    for rank in range(WORLD):
        r = res[rank][case]
        assert r["error"] is not None, f"rank {rank}: {case} completed without an error"
        assert r["is_runtime"] and r["type"] == "DistBackendError", (rank, r["type"], r["error"])
        msg = r["error"]
        assert r["elapsed"] < TIMEOUT_S / 3, f"rank {rank}: took {r['elapsed']:.1f}s (a timeout?)"
        assert r["after"] is not None and "different collective" in r["after"], (rank, r["after"])
        # On GPUs a rank's lanes run at once: a rank may find the mismatch on one lane before
        # another lane sent what would show it to a peer; it then tells its peers it gave the
        # collective up, and they fail at once naming it (layout.hpp, kAnnounceStopped).
        if re.search(r"rank \d gave up this collective because it found that the ranks issued "
                     r"different collectives", msg):
            continue
        named_both += 1
        assert "issued a different collective" in msg, f"rank {rank}: {msg}"
        mine, theirs = (odd_text, agreed_text) if rank == ODD else (agreed_text, odd_text)
        assert re.search(rf"this rank's is [^,]*{re.escape(mine)}", msg), f"rank {rank}: {msg}"
        peer = ODD if rank != ODD else r"[01]"
        assert re.search(rf"rank {peer}'s is [^.]*{re.escape(theirs)}", msg), f"rank {rank}: {msg}"
    assert named_both, f"{case}: no rank named both sides"


def assert_different_collectives_reported(res, case="ag_vs_rs", names=("all_gather", "reduce_scatter")):
    """Every rank fails within a fraction of the timeout, naming both collectives (``names``:
    patterns its message holds)."""
    for rank in range(WORLD):
        r = res[rank][case]
        assert r["error"] is not None, f"rank {rank}: {case} completed without an error"
        assert r["type"] == "DistBackendError", (rank, r["type"], r["error"])
        msg = r["error"]
        assert "issued a different collective" in msg, f"rank {rank}: {msg}"
        assert all(re.search(n, msg) for n in names), f"rank {rank}: {msg}"
        assert r["elapsed"] < TIMEOUT_S / 3, f"rank {rank}: took {r['elapsed']:.1f}s (a timeout?)"
        assert r["after"] is not None and "different collective" in r["after"], (rank, r["after"])


def test_different_collectives_fail_at_once_naming_both(run):
    assert_different_collectives_reported(run())


def assert_others_fine(res):
    """The check can be turned off, and groups that agree keep working."""
    want = [float(10 * r + i) for r in range(WORLD) for i in range(5)]
    for rank in range(WORLD):
        assert res[rank]["unchecked"] is None, f"rank {rank}: {res[rank]['unchecked']}"
        assert res[rank]["world_after"] == want, (rank, res[rank]["world_after"])


def test_check_can_be_turned_off_and_other_groups_keep_working(run):
    assert_others_fine(run())
