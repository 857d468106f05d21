"""torchtitan's llama3 debug model, unmodified, on odc through ODC_DEFAULT_BACKEND alone
(examples/recipes/torchtitan_debug.py compare): the same per-step losses as a reference,
and odc carried FSDP's all-gathers and reduce-scatters on every rank.

torchtitan trains on accelerators only. On CPU (CI) the ranks run with
tests/integrations/torchtitan_cpu_shim, which shows torchtitan a "cpu" device; the reference
there is one rank with gradient accumulation over the same samples, since torchtitan's FSDP
setup cannot train on gloo (it sets a gradient divide factor, so FSDP2 reduces with
PREMUL_SUM, which gloo refuses). On CUDA the reference is NCCL where each rank has its own
GPU, else (ranks sharing one GPU, which NCCL refuses) the same single-rank run.
"""
from __future__ import annotations

import importlib.metadata as md
import importlib.util
from pathlib import Path

import pytest
import torch

import recipe_compare



def _version() -> str | None:
    if importlib.util.find_spec("torchtitan") is None:
        return None
    return md.version("torchtitan")


VERSION = _version()
pytestmark = [
    pytest.mark.skipif(VERSION is None, reason="torchtitan is not installed (pip install torchtitan==0.2.2)"),
    pytest.mark.skipif(VERSION is not None and not VERSION.startswith("0.2."),
                       reason=f"the recipe writes torchtitan 0.2.x's TOML job config; torchtitan {VERSION} "
                              "is installed (0.3 configures jobs in Python and needs torch >= 2.12)"),
]


def run_compare(work: Path, *args: str, timeout: float = 1500) -> dict:
    return recipe_compare.run_compare("torchtitan_debug.py", "torchtitan_result.json", work, *args,
                                      timeout=timeout)


def assert_odc_carried(result: dict, device: str) -> None:
    """Every rank's default group (torchtitan's world, whose mesh FSDP uses) was odc's (its
    counters, written at exit through ODC_STATS_DIR), and odc moved all-gathers and
    reduce-scatters."""
    ranks = result["odc"]["ranks"]
    assert len(ranks) == result["nproc"], ranks
    for r in ranks:
        assert r["default_group_on_odc"], r
        counters = r["odc_counters"]
        assert counters.get("all_gather_ops", 0) > 0 and counters.get("reduce_scatter_ops", 0) > 0, r


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-shim run is for machines without a GPU "
                    "(CI); here the CUDA variant runs")
def test_torchtitan_cpu_shim_odc_equals_single_rank(tmp_path):
    steps = 6
    result = run_compare(tmp_path, "--device", "cpu", "--reference", "single", "--steps", str(steps),
                         "--seq-len", "64", "--local-batch", "4", timeout=900)
    cmp = result["compare"]["odc_vs_single"]
    assert cmp["steps"] == cmp["steps_reference"] == steps, cmp
    assert cmp["losses_bitwise_equal"], cmp
    losses = result["runs"]["odc"]["losses"]
    assert losses[-1] < losses[0], losses
    assert_odc_carried(result, "cpu")
    # the reference ran without the switch: no odc group anywhere
    assert result["runs"]["single"]["backends"]["ranks"] == [], result["runs"]["single"]["backends"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_torchtitan_cuda_odc_matches_reference(tmp_path):
    steps = 10
    result = run_compare(tmp_path, "--device", "cuda", "--reference", "auto", "--steps", str(steps))
    name = "nccl" if torch.cuda.device_count() >= 2 else "single"
    cmp = result["compare"][f"odc_vs_{name}"]
    assert cmp["steps"] == cmp["steps_reference"] == steps, cmp
    # fp32 parameters and a no-op clip: differences can only come from summation order
    assert cmp["max_rel_loss_diff"] <= 1e-5, cmp
    losses = result["runs"]["odc"]["losses"]
    assert losses[-1] < losses[0], losses
    assert_odc_carried(result, "cuda")
