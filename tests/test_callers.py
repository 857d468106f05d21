"""FSDP1 and DTensor callers on odc must train as on the stock backend, per device.

CPU ("cpu:odc"): exactly as on gloo. CUDA ("cpu:gloo,cuda:odc"): as NCCL does (a GPU per
rank: NCCL refuses ranks sharing one). One spawned job per device and world size (spawning is
the slow part on the 2-core CI box); each job runs every configuration of caller_models.CONFIGS
twice, on odc meshes and on reference meshes (backend_override), and each test compares one
configuration's results.
"""
from __future__ import annotations

import pytest
import torch

import caller_models as cm
import fsdp_models as fm
from dist_utils import GPU_ENV, cuda_case, run_distributed, run_once

REF = {"cpu": "gloo", "cuda": "nccl"}
# CPU, bitwise: every reduction odc carries here sums over 2 ranks (world 2, or the 2-rank
# shard / TP / dp groups of the 2x2 meshes) and a + b == b + a in IEEE arithmetic; all-reduces
# and scatters go to gloo in both runs (odc delegates them), and the model's own math is the
# same code on the same data in one process. Checked to be sensitive: one ulp added to one
# element of each odc reduce-scatter output, or one bit flipped in each odc all-gather output,
# fails the configurations whose collectives it touches.
# CUDA, fp32: every reduction odc carries sums over 2 ranks, as on CPU, but NCCL may compute
# AVG / scaling differently from odc (premultiplied terms), so allow a few ulp as test_fsdp2
# does. bf16 parameters (fp32 reduction): fsdp_models.assert_bf16_runs_close, as test_fsdp2.
TOL = {"cpu": dict(rtol=0, atol=0), "cuda": dict(rtol=1e-5, atol=1e-6)}
GPU_TEST_ENV = dict(GPU_ENV, CUBLAS_WORKSPACE_CONFIG=":4096:8")


def _gpu_worker(rank, world, configs):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.cuda.set_device(rank % torch.cuda.device_count())
    # Same kernels in both runs, so only the collectives can make them differ.
    torch.use_deterministic_algorithms(True, warn_only=True)
    with sdpa_kernel(SDPBackend.MATH):
        return cm.run_configs(rank, world, configs, torch.device("cuda", torch.cuda.current_device()),
                              REF["cuda"])


def _job(device, world):
    if device == "cuda":
        return run_distributed(_gpu_worker, world, cm.CONFIGS[world], backend="cpu:gloo,cuda:odc",
                               env=GPU_TEST_ENV)
    return run_distributed(cm.run_configs, world, cm.CONFIGS[world], torch.device("cpu"), REF["cpu"],
                           backend="cpu:odc", deadline_s=240)


run = run_once(_job)


def _cases(kinds):
    """(device, world, name); CUDA needs a GPU per rank."""
    cases = [(w, n) for w, cs in cm.CONFIGS.items() for n, c in cs.items() if c["kind"] in kinds]
    return ([("cpu", w, n) for w, n in cases]
            + [cuda_case("cuda", w, n, gpus=max(2, w), id=f"cuda-{w}-{n}") for w, n in cases])


@pytest.mark.parametrize("device,world,name", _cases({"fsdp1", "tp", "fsdp2_tp"}))
def test_training_matches_reference(device, world, name):
    results = run(device, world)
    losses = []
    for rank in range(world):
        res = cm.config_result(results, rank, name)
        got, ref, what = res["odc"], res["ref"], f"{name} rank {rank}"
        if device == "cuda" and cm.CONFIGS[world][name].get("bf16"):
            fm.assert_bf16_runs_close(got, ref, what=what)  # FSDP1's full parameter names are the plain model's
        else:
            cm.assert_close(got, ref, **TOL[device], what=what)
        losses.append(tuple(got["losses"]))
    if device == "cuda":
        return
    # Meaningful only if training moved the loss and the data-parallel ranks saw different
    # data (TP ranks share a batch): FSDP1 is data-parallel over all ranks, FSDP2 + TP over dp.
    assert all(len(set(l)) == len(l) for l in losses), losses
    data_parallel = {"fsdp1": world, "tp": 1, "fsdp2_tp": cm.CONFIGS[world][name]["mesh"][0]}
    assert len(set(losses)) == data_parallel[cm.CONFIGS[world][name]["kind"]], losses


@pytest.mark.parametrize("device,world,name", _cases({"redistribute"}))
def test_redistribute_is_bitwise(device, world, name):
    results = run(device, world)
    for rank in range(world):
        res = cm.config_result(results, rank, name)
        for case, r in res["ref"].items():
            assert r["gathered"] == r["src"], f"{REF[device]} {case} rank {rank}"  # the reference itself
            assert res["odc"][case]["gathered"] == r["src"], f"odc {case} rank {rank}"


@pytest.mark.parametrize("device,world,name", _cases({"fsdp1", "tp", "fsdp2_tp", "redistribute"}))
def test_odc_carried_the_collectives(device, world, name):
    need = cm.expected_odc_ops(cm.CONFIGS[world][name], device)
    for rank in range(world):
        cm.assert_used_backends(cm.config_result(run(device, world), rank, name), REF[device], need,
                                what=f"{name} rank {rank}")
