"""Lightning ModelParallelStrategy + FSDP2 on odc (examples/recipes/lightning_fsdp2.py
compare): per-step losses equal to a single-process reference of the same work (bitwise with
2 ranks) with the backend named (``process_group_backend="cpu:odc"``) and with no backend
named under ``ODC_DEFAULT_BACKEND`` (Lightning takes torch's default backend map); odc carried
FSDP2's all-gathers and reduce-scatters; Lightning on gloo (CPU) equals the same reference;
decoupled mode (manual optimization, LB-Mini: different microbatch counts per rank) within
1e-5. Lightning runs on CPU as it is: no shim. On CUDA, 2 ranks (sharing one GPU where only
one exists: the strategy is given each rank's device; NCCL, which refuses that, is then
skipped as a reference).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import recipe_compare

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None and importlib.util.find_spec("pytorch_lightning") is None,
    reason="Lightning is not installed (pip install pytorch-lightning==2.6.6, or lightning==2.6.6)")


def run_compare(work: Path, *args: str, timeout: float = 600) -> dict:
    return recipe_compare.run_compare("lightning_fsdp2.py", "lightning_result.json", work, *args,
                                      timeout=timeout, verdict=True)


@pytest.fixture(scope="module")
def cpu_result(tmp_path_factory) -> dict:
    """The CPU runs, each compared with one single-process reference (one compare command)."""
    return run_compare(tmp_path_factory.mktemp("lightning_cpu"), "--device", "cpu",
                       "--runs", "odc,default,switch,decoupled,single")


def test_lightning_cpu_named_backend_equals_single_process_and_gloo(cpu_result):
    result = cpu_result
    for name in ("odc_vs_single", "default_vs_single"):
        cmp = result["compare"][name]
        assert cmp["steps"] == 6 and cmp["losses_bitwise_equal"], (name, cmp)
    odc = result["runs"]["odc"]
    assert odc["pg_backend_string"] == "cpu:odc" and odc["mesh_group_backend"] == ["odc", "odc"]
    assert odc["losses"][-1] < odc["losses"][0], odc["losses"]
    assert result["runs"]["default"]["mesh_group_backend"] == ["gloo", "gloo"]


def test_lightning_cpu_switch_and_decoupled(cpu_result):
    result = cpu_result
    switch = result["runs"]["switch"]
    assert switch["odc_default_backend"] == "cpu" and switch["pg_backend_string"] == "odc"
    assert result["compare"]["switch_vs_single"]["losses_bitwise_equal"], result["compare"]["switch_vs_single"]
    cmp = result["compare"]["decoupled_vs_single"]
    assert cmp["steps"] == 6 and cmp["max_rel_loss_diff"] <= 1e-5, cmp
    dec = result["runs"]["decoupled"]
    counts = dec["microbatches_per_rank"]
    assert any(len({rank[s] for rank in counts}) > 1 for s in range(6)), f"LB-Mini gave equal counts: {counts}"
    assert all(c["decoupled_syncs"] == 6 for c in dec["odc_counters_per_rank"]), dec["odc_counters_per_rank"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_lightning_cuda_odc_matches_reference(tmp_path):
    result = run_compare(tmp_path, "--device", "cuda")  # default (NCCL) only with a GPU per rank
    for name, cmp in result["compare"].items():
        assert cmp["steps"] == 6 and cmp["max_rel_loss_diff"] <= 1e-5, (name, cmp)
    for name in ("odc", "switch", "decoupled"):
        assert result["runs"][name]["mesh_group_backend"] == ["odc", "odc"], name
