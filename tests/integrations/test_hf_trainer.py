"""Hugging Face Trainer + FSDP2 (through accelerate) on odc with ``ddp_backend="odc"``
(examples/recipes/hf_trainer_fsdp2.py compare): the Trainer's logged per-step losses equal
a single-process reference of the same work (bitwise with 2 ranks), odc carried FSDP2's
all-gathers and reduce-scatters, every rank trained on the batches planned for it; decoupled
mode through a TrainerCallback and the LB-Mini sampler matches the reference within 1e-5.

accelerate runs FSDP only on GPU-type devices, so on CPU (CI) the ranks run with
tests/integrations/hf_cpu_shim (it keeps the backend the Trainer names and turns FSDP on
for CPU ranks; transformers and the recipe are unchanged). There the switch run
(ODC_DEFAULT_BACKEND=cpu, no ddp_backend) also shows the switch does not reach the Trainer:
accelerate names gloo itself (nccl on GPUs), and that gloo run equals the reference too.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import recipe_compare

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None,
    reason="transformers / accelerate are not installed (pip install transformers==5.17.0 accelerate==1.15.0)")


def run_compare(work: Path, *args: str, timeout: float = 600) -> dict:
    return recipe_compare.run_compare("hf_trainer_fsdp2.py", "hf_trainer_result.json", work, *args,
                                      timeout=timeout, verdict=True)


@pytest.fixture(scope="module")
def cpu_result(tmp_path_factory) -> dict:
    """The CPU runs, each compared with one single-process reference (one compare command)."""
    return run_compare(tmp_path_factory.mktemp("hf_cpu"), "--device", "cpu",
                       "--runs", "odc,switch,decoupled,single")


def test_hf_trainer_cpu_exact_equals_single_process(cpu_result):
    result = cpu_result
    cmp = result["compare"]["odc_vs_single"]
    assert cmp["steps"] == cmp["steps_reference"] == 6, cmp
    assert cmp["losses_bitwise_equal"], cmp  # 2 ranks: every cross-rank sum has two terms
    odc = result["runs"]["odc"]
    assert odc["losses"][-1] < odc["losses"][0], odc["losses"]
    assert odc["mesh_group_backend"] == ["odc", "odc"] and odc["default_group_backends"][0]["cpu"] == "odc"


def test_hf_trainer_cpu_switch_alone_stays_on_gloo(cpu_result):
    result = cpu_result
    # the switch alone: accelerate chose gloo (accelerate state.py, PartialState._prepare_backend);
    # if this changes, the switch may now reach the Trainer: update the README
    switch = result["switch"]
    assert switch["mesh_group_backend"] == ["gloo", "gloo"] and not switch["reached_odc"], switch
    # the Trainer on gloo equals the reference too (a check of the reference itself)
    assert result["compare"]["switch_vs_single"]["losses_bitwise_equal"], result["compare"]["switch_vs_single"]


def test_hf_trainer_cpu_decoupled_callback(cpu_result):
    result = cpu_result
    cmp = result["compare"]["decoupled_vs_single"]
    assert cmp["steps"] == 6 and cmp["max_rel_loss_diff"] <= 1e-5, cmp
    dec = result["runs"]["decoupled"]
    counts = dec["planned_microbatches_per_rank"]
    assert any(len({rank[s] for rank in counts}) > 1 for s in range(6)), f"LB-Mini gave equal counts: {counts}"
    # the Trainer runs one count per rank and step: the plan is padded to it
    assert dec["gradient_accumulation_steps"] == max(max(rank) for rank in counts)
    assert all(c["decoupled_syncs"] == 6 for c in dec["odc_counters_per_rank"]), dec["odc_counters_per_rank"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_hf_trainer_cuda_odc_matches_reference(tmp_path):
    result = run_compare(tmp_path, "--device", "cuda", "--runs", "odc,decoupled,switch,single")
    for name in ("odc_vs_single", "decoupled_vs_single"):
        cmp = result["compare"][name]
        assert cmp["steps"] == 6 and cmp["max_rel_loss_diff"] <= 1e-5, (name, cmp)
    assert result["runs"]["odc"]["mesh_group_backend"] == ["odc", "odc"]
    assert not result["switch"]["reached_odc"], result["switch"]  # accelerate names nccl itself
