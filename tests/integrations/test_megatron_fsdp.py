"""Megatron-FSDP, used as its Quick Start uses it (no backend named), on odc through
ODC_DEFAULT_BACKEND alone (examples/recipes/megatron_fsdp_recipe.py compare): per-rank
per-step losses equal to a single-process reference with Megatron-FSDP's optimizer
arrangement, and odc carried the coalesced all-gathers and reduce-scatters.

Megatron-FSDP runs on CUDA only. On CPU (CI) the ranks run with
tests/integrations/megatron_fsdp_cpu_shim (stand-ins for CUDA streams and events, a CPU
mesh); gloo cannot be the reference there (Megatron-FSDP reduces gradients with
PREMUL_SUM, which gloo refuses). On CUDA the reference is also NCCL where each rank has
its own GPU (NCCL refuses ranks sharing one).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import recipe_compare

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron_fsdp") is None,
                                reason="megatron-fsdp is not installed (pip install megatron-fsdp==0.6.1)")


def run_compare(work: Path, *args: str, timeout: float = 900) -> dict:
    return recipe_compare.run_compare("megatron_fsdp_recipe.py", "megatron_fsdp_result.json", work, *args,
                                      timeout=timeout)


def assert_odc_carried(result: dict, device: str) -> None:
    odc = result["runs"]["odc"]
    assert odc["default_group_backends"].get(device) == "odc", odc["default_group_backends"]
    assert len(odc["odc_counters_per_rank"]) == result["nproc"]
    for rank, counters in enumerate(odc["odc_counters_per_rank"]):
        assert counters.get("all_gather_ops", 0) > 0 and counters.get("reduce_scatter_ops", 0) > 0, (rank, counters)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-shim run is for machines without a GPU "
                    "(CI); here the CUDA variant runs")
def test_megatron_fsdp_cpu_shim_odc_equals_single_process(tmp_path):
    steps = 6
    result = run_compare(tmp_path, "--device", "cpu", "--reference", "single", "--steps", str(steps),
                         "--layers", "2", "--d-model", "64", "--heads", "4", "--vocab", "128",
                         "--seq", "32", "--batch", "4")
    cmp = result["compare"]["odc_vs_single"]
    assert cmp["steps"] == steps and cmp["losses_bitwise_equal"], cmp
    losses = result["runs"]["odc"]["global_losses"]
    assert losses[-1] < losses[0], losses
    assert_odc_carried(result, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_megatron_fsdp_cuda_odc_matches_reference(tmp_path):
    steps = 20
    result = run_compare(tmp_path, "--device", "cuda", "--reference", "auto", "--steps", str(steps))
    for name, cmp in result["compare"].items():
        assert cmp["steps"] == steps, (name, cmp)
        # fp32, 2 ranks: every sum odc computes has two terms (exact in any order)
        assert cmp["max_abs_loss_diff"] <= 1e-5, (name, cmp)
    losses = result["runs"]["odc"]["global_losses"]
    assert losses[-1] < losses[0], losses
    assert_odc_carried(result, "cuda")
