"""FSDP1 and DTensor callers on CUDA: "cpu:gloo,cuda:odc" must train as NCCL does.

The same configurations and worker as the CPU test (caller_models): each job runs every
configuration on odc meshes and on NCCL meshes (backend_override="nccl") in one process.
"""
from __future__ import annotations

import pytest
import torch

import caller_models as cm
import fsdp_models as fm
from dist_utils import GPU_ENV, run_distributed, run_once

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 CUDA GPUs")

ODC, REF = "cpu:gloo,cuda:odc", "nccl"
ENV = dict(GPU_ENV, CUBLAS_WORKSPACE_CONFIG=":4096:8")
WORLDS = [w for w in sorted(cm.CONFIGS) if w <= torch.cuda.device_count()]
# fp32: every reduction odc carries sums over 2 ranks, as on CPU, but NCCL may compute AVG /
# scaling differently from odc (premultiplied terms), so allow a few ulp as test_gpu_fsdp2 does.
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
# bf16 parameters (fp32 reduction), as test_gpu_fsdp2: an ulp of fp32 difference can flip a
# bf16 rounding in the next forward, so losses, norms and gradients may drift by ~1e-3
# relative; final weights are compared against the size of the training update itself.
BF16_RTOL, BF16_UPDATE_RTOL = 1e-2, 5e-2


def _worker(rank, world, configs):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.cuda.set_device(rank % torch.cuda.device_count())
    # Same kernels in both runs, so only the collectives can make them differ.
    torch.use_deterministic_algorithms(True, warn_only=True)
    with sdpa_kernel(SDPBackend.MATH):
        return cm.run_configs(rank, world, configs, torch.device("cuda", torch.cuda.current_device()), REF)


run = run_once(lambda world: run_distributed(_worker, world, cm.CONFIGS[world], backend=ODC, env=ENV))


def _cases(kinds):
    return [(w, n) for w in WORLDS for n, c in cm.CONFIGS[w].items() if c["kind"] in kinds]


def _assert_rel_close(got, ref, base, tol, what):
    """Per tensor: |got - ref| <= tol * |base| (Frobenius norms)."""
    for name, r in ref.items():
        diff = (torch.as_tensor(got[name]) - torch.as_tensor(r)).norm()
        scale = torch.as_tensor(base[name]).norm()
        assert scale > 0 and diff <= tol * scale, f"{what} {name}: |odc-nccl|={diff:.3g} vs {tol}*{scale:.3g}"


@pytest.mark.parametrize("world,name", _cases({"fsdp1", "tp", "fsdp2_tp"}))
def test_gpu_training_matches_nccl(world, name):
    for rank in range(world):
        res = cm.config_result(run(world), rank, name)
        got, ref, what = res["odc"], res["ref"], f"{name} rank {rank}"
        if not cm.CONFIGS[world][name].get("bf16"):
            cm.assert_close(got, ref, **FP32_TOL, what=what)
            continue
        for key in ("losses", "norms"):
            torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(ref[key]), rtol=BF16_RTOL, atol=0,
                                       msg=lambda m, key=key: f"{what} {key}: {m}")
        _assert_rel_close(got["grads"], ref["grads"], ref["grads"], BF16_RTOL, f"{what} grad")
        init = fm.init_params()  # FSDP1's full parameter names are the plain model's
        updates = {n: torch.as_tensor(p) - init[n] for n, p in ref["params"].items()}
        _assert_rel_close(got["params"], ref["params"], updates, BF16_UPDATE_RTOL, f"{what} param")


@pytest.mark.parametrize("world,name", _cases({"redistribute"}))
def test_gpu_redistribute_is_bitwise(world, name):
    for rank in range(world):
        res = cm.config_result(run(world), rank, name)
        for case, r in res["ref"].items():
            assert r["gathered"] == r["src"], f"{REF} {case} rank {rank}"
            assert res["odc"][case]["gathered"] == r["src"], f"odc {case} rank {rank}"


@pytest.mark.parametrize("world,name", _cases({"fsdp1", "tp", "fsdp2_tp", "redistribute"}))
def test_gpu_odc_carried_the_collectives(world, name):
    need = cm.expected_odc_ops(cm.CONFIGS[world][name], "cuda")
    for rank in range(world):
        cm.assert_used_backends(cm.config_result(run(world), rank, name), REF, need, what=f"{name} rank {rank}")
