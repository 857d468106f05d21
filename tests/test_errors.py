"""Error handling of the "odc" backend on CPU: bad arguments raise before anything is
enqueued (and the group keeps working), a dead or stuck peer turns into a timeout error."""
from __future__ import annotations

import json
import os
import re
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from test_collectives import SMALL_RING, ag_case, check_case

F32, BF16 = torch.float32, torch.bfloat16
TIMEOUT_S = 5.0
TIMEOUT_RE = r"(?i)time[d ]?\s*out"
# Bad arguments: ValueError (sizes, devices, ops), TypeError (dtypes), RuntimeError (other).
ARG_ERRORS = (RuntimeError, ValueError, TypeError)


def _ag(out, inp, async_op):
    return dist.all_gather_into_tensor(out, inp, async_op=async_op)


def _rs(out, inp, async_op, op=dist.ReduceOp.SUM):
    return dist.reduce_scatter_tensor(out, inp, op=op, async_op=async_op)


def _coalesced_ag(world, bad_out):
    """Two all-gathers coalesced into one backend call; the second one's output is wrong."""
    def call(async_op):
        with dist.distributed_c10d._coalescing_manager(async_ops=async_op) as cm:
            dist.all_gather_into_tensor(torch.empty(world * 4), torch.ones(4))
            dist.all_gather_into_tensor(bad_out, torch.ones(3))
        return cm if async_op else None
    return call


def error_cases(world: int, n: int = 6):
    """(name, regex the message must match, fn(async_op) issuing the bad call)."""
    e = torch.empty
    noncontig = lambda numel, dtype=F32: e(2 * numel, dtype=dtype)[::2]  # noqa: E731
    return [
        ("AG output too large", "size", lambda a: _ag(e(world * n + 1), e(n), a)),
        ("AG output too small", "size", lambda a: _ag(e(world * n - 1), e(n), a)),
        ("AG 2-D output, wrong numel", "size", lambda a: _ag(e(world, n + 1), e(n), a)),
        ("RS output too large", "size", lambda a: _rs(e(n + 1), e(world * n), a)),
        ("RS input too small", "size", lambda a: _rs(e(n), e(world * n - 1), a)),
        ("AG dtype mismatch", "dtype", lambda a: _ag(e(world * n, dtype=BF16), e(n), a)),
        ("AG int64 vs int32", "dtype", lambda a: _ag(e(world * n, dtype=torch.int32), e(n, dtype=torch.int64), a)),
        ("RS dtype mismatch", "dtype", lambda a: _rs(e(n, dtype=torch.float16), e(world * n), a)),
        ("AG non-contiguous input", "contiguous", lambda a: _ag(e(world * n), noncontig(n), a)),
        ("AG non-contiguous output", "contiguous", lambda a: _ag(noncontig(world * n), e(n), a)),
        ("AG transposed input", "contiguous", lambda a: _ag(e(world * n), e(3, 2).t(), a)),
        ("RS non-contiguous input", "contiguous", lambda a: _rs(e(n), noncontig(world * n), a)),
        ("RS non-contiguous output", "contiguous", lambda a: _rs(noncontig(n, BF16), e(world * n, dtype=BF16), a)),
        # (reduce-scatters with bitwise ops go to the inner backend: tests/test_knob_errors.py)
        ("RS AVG of int64", "AVG needs a floating", lambda a: _rs(torch.zeros(n, dtype=torch.int64), torch.zeros(world * n, dtype=torch.int64), a, dist.ReduceOp.AVG)),
        ("RS complex64", "dtype", lambda a: _rs(torch.zeros(n, dtype=torch.complex64), torch.zeros(world * n, dtype=torch.complex64), a)),
        ("coalesced AG, 2nd output wrong size", "size", _coalesced_ag(world, e(world * 3 + 2))),
    ]


def expect_error(fn, async_op, pattern) -> str | None:
    """None if fn raised RuntimeError/ValueError matching pattern at call time, else a complaint."""
    try:
        work = fn(async_op)
    except ARG_ERRORS as exc:
        return None if re.search(pattern, str(exc), re.I) else f"message does not match /{pattern}/: {exc}"
    except Exception as exc:  # noqa: BLE001
        return f"raised {type(exc).__name__} (want RuntimeError/ValueError): {exc}"
    if work is not None:
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001
            return f"raised only at wait(), not at the call: {exc}"
    return "no exception"


def _errors_worker(rank, world):
    failures = []
    for i, (name, pattern, fn) in enumerate(error_cases(world)):
        for async_op in (False, True):
            what = f"{name} (async_op={async_op})"
            problem = expect_error(fn, async_op, pattern)
            if problem:
                failures.append(f"{what}: {problem}")
            # The group must still work after the error.
            c = ag_case(10 * i + async_op, 1000 + i, F32, rank, world, offset=i % 4)
            dist.all_gather_into_tensor(c["out"], c["inp"])
            failures += check_case(c, f"all-gather after {what}")
    return failures


def test_bad_arguments_raise_and_group_survives():
    res = run_distributed(_errors_worker, 2, env=SMALL_RING, timeout_s=20, deadline_s=120)
    failures = [f"rank {r}: {f}" for r in sorted(res) for f in res[r]]
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------- dead / stuck peer
# Survivors record how their collective failed in <tmpdir>/rank<r>.json (the peer that exits
# never reports, and a hang in shutdown must not hide the result); the stuck peer waits for
# those files. Reused by test_collectives.py's CUDA tests.
PEER = 1


def result_path(tmpdir, rank):
    return os.path.join(tmpdir, f"rank{rank}.json")


def wait_for_survivors(tmpdir, world, limit_s=TIMEOUT_S + 40):
    paths = [result_path(tmpdir, r) for r in range(world) if r != PEER]
    end = time.monotonic() + limit_s
    while time.monotonic() < end and not all(os.path.exists(p) for p in paths):
        time.sleep(0.1)


def record_failure(tmpdir, rank, body):
    """Run body() (the collectives the peer does not join) and record if/how/when it raised."""
    t0 = time.monotonic()
    res = dict(error=None)
    try:
        body()
    except Exception as exc:  # noqa: BLE001
        res = dict(error=f"{type(exc).__name__}: {exc}"[:3000], runtime_error=isinstance(exc, RuntimeError))
    res["elapsed"] = time.monotonic() - t0
    path = result_path(tmpdir, rank)
    with open(path + ".tmp", "w") as f:
        json.dump(res, f)
    os.rename(path + ".tmp", path)


def check_peer_failure(worker, world, mode, tmp_path, *args, backend="cpu:odc", env=SMALL_RING):
    """Run worker(rank, world, mode, tmpdir, *args) and check the survivors' records."""
    t0 = time.monotonic()
    try:
        run_distributed(worker, world, mode, str(tmp_path), *args, backend=backend, env=env,
                        timeout_s=TIMEOUT_S, deadline_s=TIMEOUT_S + 90)
        harness = "ok"
    except AssertionError as exc:
        harness = str(exc)
    total = time.monotonic() - t0
    for r in (r for r in range(world) if r != PEER):
        p = tmp_path / f"rank{r}.json"
        assert p.exists(), f"rank {r} never finished its collective; run_distributed said:\n{harness}"
        res = json.loads(p.read_text())
        assert res["error"] is not None, f"rank {r}: the collective completed without peer {PEER}"
        assert res["runtime_error"], f"rank {r}: not a RuntimeError: {res['error']}"
        # a peer process that is gone (reaped: not a zombie of its parent) is named at once
        want = TIMEOUT_RE if mode == "sleep" else rf"{TIMEOUT_RE}|rank {PEER} \(pid \d+\) has exited"
        assert re.search(want, res["error"]), f"rank {r}: message lacks {want!r}: {res['error']}"
        assert res["elapsed"] <= TIMEOUT_S + 10, f"rank {r}: took {res['elapsed']:.1f}s to fail"
        if mode == "sleep":  # a live peer must get the whole timeout
            assert res["elapsed"] >= TIMEOUT_S * 0.9, f"rank {r}: gave up after {res['elapsed']:.1f}s"
    # The processes must also shut down (no hang in destroy_process_group / at exit).
    expected = f"distributed run failed: missing ranks [{PEER}] (hung or died)" if mode == "exit" else "ok"
    assert harness == expected, f"clean shutdown expected, run_distributed said:\n{harness}"
    assert total < TIMEOUT_S + 60, f"run took {total:.0f}s"


def _dead_peer_worker(rank, world, mode, tmpdir, async_op):
    # A peer that is late but inside the timeout is fine.
    if rank == PEER:
        time.sleep(TIMEOUT_S / 2)
    c = ag_case(1, 999, F32, rank, world)
    dist.all_gather_into_tensor(c["out"], c["inp"])
    assert not check_case(c, "late-peer AG"), check_case(c, "late-peer AG")
    if rank == PEER:
        if mode == "exit":
            os._exit(0)
        wait_for_survivors(tmpdir, world)  # stuck: never calls the collective
        return None
    c = ag_case(2, 5000, F32, rank, world)

    def body():
        work = dist.all_gather_into_tensor(c["out"], c["inp"], async_op=async_op)
        if work is not None:
            work.wait()
    record_failure(tmpdir, rank, body)


@pytest.mark.parametrize("mode,async_op", [("exit", False), ("sleep", False), ("sleep", True)])
def test_dead_or_stuck_peer_times_out(mode, async_op, tmp_path):
    check_peer_failure(_dead_peer_worker, 3, mode, tmp_path, async_op)


LONG_TIMEOUT_S, SHORT_TIMEOUT_S = 60.0, 3.0


def _changed_timeout_worker(rank, world, tmpdir):
    """The group is made with a 60 s timeout, runs an all-gather (its transport is set up),
    then every rank sets 3 s; the peer then never joins the next all-gather."""
    from datetime import timedelta

    c = ag_case(1, 999, F32, rank, world)
    dist.all_gather_into_tensor(c["out"], c["inp"])
    # every backend of the group (torch's _set_pg_timeout skips backends other than NCCL and gloo)
    dist.group.WORLD.set_timeout(timedelta(seconds=SHORT_TIMEOUT_S))
    if rank == PEER:
        wait_for_survivors(tmpdir, world, limit_s=LONG_TIMEOUT_S)  # stuck
        os._exit(0)
    c = ag_case(2, 5000, F32, rank, world)
    record_failure(tmpdir, rank, lambda: dist.all_gather_into_tensor(c["out"], c["inp"]))


def test_a_changed_timeout_reaches_a_running_group(tmp_path):
    try:
        run_distributed(_changed_timeout_worker, 2, str(tmp_path), env=SMALL_RING,
                        timeout_s=LONG_TIMEOUT_S, deadline_s=90)
    except AssertionError:
        pass  # the peer exits without reporting: judged by the survivor's record below
    res = json.loads((tmp_path / "rank0.json").read_text())
    assert res["error"] is not None and re.search(TIMEOUT_RE, res["error"]), res
    assert SHORT_TIMEOUT_S * 0.9 <= res["elapsed"] <= 2 * SHORT_TIMEOUT_S, res


def _window_too_large_worker(rank, world):
    out, inp = torch.empty(8 * world), torch.ones(8)
    try:
        dist.all_gather_into_tensor(out, inp)
    except RuntimeError as exc:
        return str(exc)
    return None


def test_window_that_cannot_be_allocated_raises_clearly():
    # 1 TiB ring slots: the shared-memory window cannot be backed, on every rank alike.
    msgs = run_distributed(_window_too_large_worker, 2, env={"ODC_CHUNK_BYTES": "1G",
                                                             "ODC_RING_SLOTS": "1024"},
                           deadline_s=120)
    for rank, msg in msgs.items():
        assert msg is not None, f"rank {rank}: an impossible window was allocated"
        assert re.search(r"MiB", msg) and "ODC_CHUNK_BYTES" in msg, f"rank {rank}: {msg}"
