"""Public c10d APIs of newer torch releases, on "cpu:odc" (2 ranks, one job):

- ``dist.all_gather_single`` / ``dist.reduce_scatter_single`` (torch 2.13's Python API; from
  2.14 c10d's Backend has virtuals of these names that forward to ``_allgather_base`` /
  ``_reduce_scatter_base``, which odc overrides): right results, served by odc's one-sided
  path (its counters move).
- ``dist.set_timeout`` (torch 2.14): reaches odc's backend (``OdcBackend::setTimeout``, the
  same path as ``group.set_timeout``, whose effect on a waiting collective
  test_errors.py checks), on the default group and on a new group, without c10d's warning
  for backends that cannot change their timeout.

An API the installed torch lacks skips its test, naming it.
"""
from __future__ import annotations

import datetime
import warnings

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed, run_once

WORLD, N = 2, 5


def _needs(name):
    return pytest.mark.skipif(not hasattr(dist, name),
                              reason=f"torch {torch.__version__} has no torch.distributed.{name}")


def _counters(backend):
    s = dict(backend.stats())
    return {k: s.get(k, 0) for k in ("all_gather_ops", "reduce_scatter_ops")}


def _worker(rank, world):
    cpu = torch.device("cpu")
    odc = dist.group.WORLD._get_backend(cpu)
    out = {"backend": odc.name()}
    x = torch.arange(N, dtype=torch.float32) + 10 * rank
    if hasattr(dist, "all_gather_single"):
        before = _counters(odc)
        y = torch.full((world * N,), -1.0)
        dist.all_gather_single(y, x)
        z = torch.full((world, N), -1.0)  # the stacked form
        dist.all_gather_single(z, x, async_op=True).wait()
        out["all_gather_single"] = (y.tolist(), z.reshape(-1).tolist())
        out["all_gather_ops"] = _counters(odc)["all_gather_ops"] - before["all_gather_ops"]
    if hasattr(dist, "reduce_scatter_single"):
        before = _counters(odc)
        inp = torch.arange(world * N, dtype=torch.float32) * (rank + 1)
        s, a = torch.empty(N), torch.empty(N)
        dist.reduce_scatter_single(s, inp)
        dist.reduce_scatter_single(a, inp, op=dist.ReduceOp.AVG)
        out["reduce_scatter_single"] = (s.tolist(), a.tolist())
        out["reduce_scatter_ops"] = _counters(odc)["reduce_scatter_ops"] - before["reduce_scatter_ops"]
    if hasattr(dist, "set_timeout"):
        sub = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=60))
        sub_odc = sub._get_backend(cpu)
        out["timeouts_before"] = (odc.options._timeout, sub_odc.options._timeout)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dist.set_timeout(datetime.timedelta(seconds=7))
            dist.set_timeout(datetime.timedelta(seconds=9), group=sub)
        out["timeouts_after"] = (odc.options._timeout, sub_odc.options._timeout)
        out["warnings"] = [str(w.message) for w in caught]
        # the groups still work (their transports now wait up to the new timeouts)
        y = torch.empty(world * N)
        dist.all_gather_into_tensor(y, x, group=sub)
        out["after_set_timeout"] = y.tolist()
    return out


@pytest.fixture(scope="module")
def run():
    return run_once(lambda: run_distributed(_worker, WORLD, timeout_s=60, deadline_s=120))


def _gathered():
    return [float(v + 10 * r) for r in range(WORLD) for v in range(N)]


@_needs("all_gather_single")
def test_all_gather_single_is_served_by_odc(run):
    for rank, res in run().items():
        assert res["backend"] == "odc"
        flat, stacked = res["all_gather_single"]
        assert flat == _gathered() and stacked == _gathered(), (rank, res)
        assert res["all_gather_ops"] == 2, (rank, res)


@_needs("reduce_scatter_single")
def test_reduce_scatter_single_is_served_by_odc(run):
    total = sum(r + 1 for r in range(WORLD))
    for rank, res in run().items():
        s, a = res["reduce_scatter_single"]
        expect = [float((rank * N + i) * total) for i in range(N)]
        assert s == expect and a == [v / WORLD for v in expect], (rank, res)
        assert res["reduce_scatter_ops"] == 2, (rank, res)


@_needs("set_timeout")
def test_set_timeout_reaches_odc(run):
    for rank, res in run().items():
        assert res["timeouts_before"] == (datetime.timedelta(seconds=60),) * 2, (rank, res)
        assert res["timeouts_after"] == (datetime.timedelta(seconds=7), datetime.timedelta(seconds=9)), (rank, res)
        assert not [w for w in res["warnings"] if "timeout" in w], (rank, res["warnings"])
        assert res["after_set_timeout"] == _gathered(), (rank, res)
