"""torch 2.13 renames all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
reduce_scatter_single (the old names warn there): odc serves both spellings with the same
results, and the package itself calls the names that do not warn on the running torch."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed

WORLD = 2
NEW_NAMES = hasattr(dist, "all_gather_single") and hasattr(dist, "reduce_scatter_single")


def _worker(rank, world):
    x = torch.arange(6, dtype=torch.float32) + 10 * rank
    big = torch.arange(world * 4, dtype=torch.float32) * (rank + 1)
    out = {}
    spellings = {"old": (dist.all_gather_into_tensor, dist.reduce_scatter_tensor)}
    if NEW_NAMES:
        spellings["new"] = (dist.all_gather_single, dist.reduce_scatter_single)
    for name, (gather, scatter) in spellings.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ag = torch.empty(world * 6)
            gather(ag, x)
            rs = torch.empty(4)
            scatter(rs, big, op=dist.ReduceOp.SUM)
        out[name] = dict(ag=ag.tolist(), rs=rs.tolist(),
                         future_warnings=sum(issubclass(w.category, FutureWarning) for w in caught))
    return out


def test_both_spellings_give_the_same_results():
    res = run_distributed(_worker, WORLD, backend="cpu:odc", deadline_s=120)
    want_ag = [float(10 * r + i) for r in range(WORLD) for i in range(6)]
    for rank in range(WORLD):
        want_rs = [float(sum((r + 1) * (rank * 4 + i) for r in range(WORLD))) for i in range(4)]
        for name, r in res[rank].items():
            assert r["ag"] == want_ag and r["rs"] == want_rs, (rank, name, r)
        if NEW_NAMES:
            assert res[rank]["new"]["future_warnings"] == 0, res[rank]["new"]


@pytest.mark.skipif(not NEW_NAMES, reason="this torch has no all_gather_single / reduce_scatter_single")
def test_package_and_examples_use_the_names_that_do_not_warn():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = [*root.glob("torch_odc_backend/**/*.py"), *root.glob("examples/**/*.py"),
             *root.glob("benchmarks/*.py")]
    offenders = []
    for f in files:
        for i, line in enumerate(f.read_text().splitlines(), 1):
            code = line.split("#")[0]
            for old in ("dist.all_gather_into_tensor(", "dist.reduce_scatter_tensor("):
                if old in code:
                    offenders.append(f"{f.relative_to(root)}:{i}: {line.strip()}")
    assert not offenders, "calls of names torch 2.13 deprecates:\n" + "\n".join(offenders)
