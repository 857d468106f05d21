"""The end-to-end benchmark's CPU version runs, trains the same model in every configuration,
and its timeline plot draws: benchmarks/train_imbalanced.py and benchmarks/plot_timeline.py
under torchrun with 2 processes, tiny settings (the GPU version runs on the GPU machine)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("train_imbalanced")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(REPO / "benchmarks" / "train_imbalanced.py"), "--steps", "3", "--docs-per-step", "6",
         "--layers", "2", "--straggler", "1:1.2", "--out-dir", str(out),
         "--configs", "reference_lbmicro,exact_lbmicro,decoupled_lbmini,decoupled_dynamic,decoupled_adaptive"],
        cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", ODC_BENCH_KIND="test"),
        capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{log[-4000:]}"
    (path,) = out.glob("train_imbalanced_test_straggler_*.json")
    return path, json.loads(path.read_text())


def test_every_configuration_trains_the_same_model(result):
    _, data = result
    res = data["results"]
    assert set(res) == {"reference_lbmicro", "exact_lbmicro", "decoupled_lbmini", "decoupled_dynamic",
                        "decoupled_adaptive"}
    ref = res["reference_lbmicro"]["loss_per_step"]
    assert len(ref) == 2 and all(v > 0 for v in ref)
    for name in ("exact_lbmicro", "decoupled_lbmini", "decoupled_dynamic", "decoupled_adaptive"):
        # same documents, same tokens, same initial weights, equal gradients: same losses
        assert res[name]["loss_per_step"] == pytest.approx(ref, rel=1e-5), name
    # every configuration trained every document of a minibatch exactly once, with its length
    for name, r in res.items():
        for step, docs in enumerate(data["documents"][1:]):
            seen = sorted((i, n) for line in r["timelines"]
                          for what, _s, _e, _t, lengths, idx in line[step] if what == "micro"
                          for i, n in zip(idx, lengths))
            assert seen == list(enumerate(docs)), (name, step)


def test_report_fields(result):
    _, data = result
    s = data["summary"]
    assert s["ideal_speedup"] >= 1.0
    assert "decoupled_speedup_over_ideal" in s and "microbatch_time_fit" in s
    for key in ("speedup_dynamic_vs_nccl_lbmicro", "speedup_dynamic_vs_static_lbmini", "fraction_of_balance_bound"):
        assert s[key] > 0, key
    # the bound is a lower bound of the dynamic run's own measured microbatches
    assert s["balance_bound"]["measured_s"] <= sum(data["results"]["decoupled_dynamic"]["minibatch_times_s"])
    # the calibration timed its seven shapes (the mean over ranks) and fitted them
    assert [c["lengths"] for c in data["calibration"]][:2] == [[768], [384]]
    assert all(c["seconds"] > 0 for c in data["calibration"])
    for res in data["results"].values():
        steps = len(data["documents"]) - 1
        assert len(res["timelines"]) == 2 and len(res["step_times_s"]) == steps
        # the reported rate is the tokens over the slowest rank's step times
        tokens = sum(map(sum, data["documents"][1:]))
        assert res["tokens_per_s"] == pytest.approx(tokens / sum(res["step_times_s"]))


def test_timeline_plot(result, tmp_path):
    path, _ = result
    png = tmp_path / "timeline.png"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "plot_timeline.py"), str(path),
                           "--out", str(png)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert png.stat().st_size > 10_000


def _results_folder() -> tuple[dict, str]:
    """benchmarks/results: each file's (size, mtime), and what git says of the folder."""
    folder = REPO / "benchmarks" / "results"
    files = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}
    git = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--", str(folder)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    return files, git.stdout if git.returncode == 0 else "(no git)"


def test_default_run_leaves_the_checkout_alone(tmp_path):
    """As docs/performance.md shows it (no --out-dir, run from the checkout): the result goes
    under the system's temporary folder, which the run names, and benchmarks/results is
    untouched (its committed headline files are written only with --out-dir benchmarks/results)."""
    before = _results_folder()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "benchmarks/train_imbalanced.py", "--steps", "2", "--docs-per-step", "4", "--layers", "1",
         "--configs", "exact_lbmicro", "--cost", "flops"],
        cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path), ODC_BENCH_KIND="test"),
        capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{log[-4000:]}"
    (path,) = (tmp_path / "odc_results").glob("train_imbalanced_test_*.json")
    assert f"[train_imbalanced] wrote {path}" in proc.stdout, log[-4000:]
    assert _results_folder() == before
