"""Figures of the verl comparison (examples/recipes/verl_sft.py), from inputs written by hand:
the GPU memory (verl_memory_probe.py and the memory summary: the peak per rank, the least a rank
held between the first and last timed step's ends, i.e. while verl had offloaded, and odc's
extra over verl's engine), and the equality checks against verl's engine's own run-to-run
spread. No verl or GPU needed."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[2] / "examples" / "recipes"
GIB = 2**30


@pytest.fixture
def recipes(monkeypatch):
    monkeypatch.syspath_prepend(str(RECIPES))
    import verl_memory_probe
    import verl_sft

    yield verl_memory_probe, verl_sft
    for name in ("verl_memory_probe", "verl_sft", "odc_stats"):
        sys.modules.pop(name, None)


def write(folder: Path, rank: int, samples: list) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{rank}.json").write_text(json.dumps([[t] + [int(gb * GIB) for gb in x] for t, *x in samples]))


def test_probe_reads_the_peak_and_the_level_held_between_steps(tmp_path, recipes):
    probe, _ = recipes
    # loaded during the steps (t 1 and 3), offloaded between them (t 2 and 4); before the first
    # timed step's end (start-up) and after the last (exit) it held less: not counted
    # (time, used, reserved, allocated)
    write(tmp_path, 0, [(0, 0.5, 0, 0), (1, 10.0, 8, 7), (2, 1.0, 0.5, 0.25), (3, 10.0, 8, 7), (4, 1.25, 0.5, 0.25),
                        (9, 0.2, 0, 0)])
    write(tmp_path, 1, [(0, 0.5, 0, 0), (1, 9.0, 7, 6), (2, 1.5, 1, 0.5), (3, 9.0, 7, 6), (4, 1.5, 1, 0.5)])
    got = probe.read(tmp_path, start=1.5, end=4.5)
    assert got["peak_used_gb"] == [10.0, 9.0]
    assert got["least_used_between_steps_gb"] == [1.0, 1.5]
    assert got["reserved_then_gb"] == [0.5, 1.0] and got["allocated_then_gb"] == [0.25, 0.5]
    assert probe.read(tmp_path / "missing", 0, 1) == {}


def test_summary_gives_the_peak_ratio_and_odcs_extra_held_memory(tmp_path, recipes):
    probe, sft = recipes
    write(tmp_path / "stock", 0, [(1, 10.0, 8, 7), (2, 1.0, 0.5, 0.25)])
    write(tmp_path / "stock", 1, [(1, 9.0, 7, 6), (2, 1.5, 1, 0.5)])
    write(tmp_path / "odc", 0, [(1, 10.5, 8, 7), (2, 1.25, 0.5, 0.25)])
    write(tmp_path / "odc", 1, [(1, 9.0, 7, 6), (2, 1.75, 1, 0.5)])
    stock = {"device_memory": probe.read(tmp_path / "stock", 0, 3)}
    odc = {"device_memory": probe.read(tmp_path / "odc", 0, 3)}
    s = sft.memory_summary(stock, odc, "_straggler")
    assert s["peak_device_memory_ratio_straggler"] == pytest.approx(1.05)
    assert s["held_between_steps_gb_stock_straggler"] == 1.5
    assert s["held_between_steps_gb_odc_straggler"] == 1.75
    assert s["held_between_steps_extra_mib_straggler"] == pytest.approx(256.0)
    assert sft.memory_summary(stock, {}, "") == {}  # a run without the probe: no figures


def test_a_difference_within_verls_own_spread_counts_as_equal(recipes):
    _, sft = recipes
    stock = {"losses": [2.0, 1.0], "grad_norms": [5.0, 4.0]}
    stock_again = {"losses": [2.0, 1.01], "grad_norms": [5.0, 4.2]}  # spread: 1 % and 5 %
    for odc, passed in (({"losses": [2.0, 1.005], "grad_norms": [5.0, 4.16]}, {"losses equal", "gradient norms equal"}),
                        ({"losses": [2.0, 1.02], "grad_norms": [5.0, 4.3]}, set())):
        compared = {k: sft.close(odc[k], stock[k], 1e-3) for k in ("losses", "grad_norms")}
        checks = {"losses equal": (compared["losses"]["equal"], "l"),
                  "gradient norms equal": (compared["grad_norms"]["equal"], "g")}
        got = sft.within_own_spread(compared, checks, stock, stock_again, 1e-3)
        assert set(got) == passed and all(ok for ok, _ in got.values())
        assert compared["stock_against_itself"]["grad_norms"]["max_rel_diff"] == pytest.approx(0.05)
    # a check that passed on its own is left as it was
    compared = {k: sft.close(stock[k], stock[k], 1e-3) for k in ("losses", "grad_norms")}
    assert sft.within_own_spread(compared, {"losses equal": (True, ""), "gradient norms equal": (True, "")},
                                 stock, stock_again, 1e-3) == {}
