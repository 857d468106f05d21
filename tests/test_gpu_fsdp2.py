"""FSDP2 training on GPUs under "cpu:gloo,cuda:odc" must match the same training under NCCL."""
from __future__ import annotations

import pytest
import torch

import fsdp_models as fm
from dist_utils import GPU_ENV, run_distributed

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 CUDA GPUs")

N = torch.cuda.device_count()
CONFIGS = {
    "bf16_1d": dict(mesh=(N,), bf16=True),
    "fp32_1d_noreshard_accum_clip": dict(mesh=(N,), reshard_after_forward=False, grad_accum=2, clip_norm=0.05),
}
if N >= 4 and N % 2 == 0:
    HSDP = dict(mesh=(2, N // 2), dims=("replicate", "shard"))
    CONFIGS.update(bf16_hsdp=dict(HSDP, bf16=True), fp32_hsdp=dict(HSDP, grad_accum=2))
ODC, REF = "cpu:gloo,cuda:odc", "nccl"
ENV = dict(GPU_ENV, CUBLAS_WORKSPACE_CONFIG=":4096:8")
# fp32: as on CPU, only the summation order inside a reduction may differ from NCCL's.
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
# bf16 params / fp32 reduction: a few-ulp fp32 difference in a master weight can flip
# its bf16 rounding (2^-8 relative) for the next forward, so losses, grad norms and
# (per tensor, in norm) gradients may drift by ~1e-3 relative; a wrong shard, offset
# or scale moves them by far more than 1e-2.
BF16_RTOL = 1e-2
# ... and final weights: AdamW moves each weight by ~lr per step, so compare the
# difference against the size of the update itself, per tensor.
BF16_UPDATE_RTOL = 5e-2


def _worker(rank, world, configs):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.cuda.set_device(rank % torch.cuda.device_count())  # the harness does so only for "cuda" backends
    device = torch.device("cuda", torch.cuda.current_device())
    # Same kernels in both runs, so only the collectives can make them differ.
    torch.use_deterministic_algorithms(True, warn_only=True)
    meshes, out = {}, {}
    with fm.CallSpy() as spy, sdpa_kernel(SDPBackend.MATH):
        for name, cfg in configs.items():
            cfg = dict(cfg)
            key = (cfg.pop("mesh"), cfg.pop("dims", None))
            if key not in meshes:
                meshes[key] = init_device_mesh("cuda", key[0], mesh_dim_names=key[1])
            if cfg.pop("bf16", False):
                cfg["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            out[name] = fm.train(meshes[key], device=device, **cfg)
    torch.cuda.synchronize()
    return fm.to_wire({"configs": out, "calls": dict(spy.calls), "groups": fm.group_report(spy, "cuda")})


@pytest.fixture(scope="module")
def runs():
    return {b: run_distributed(_worker, N, CONFIGS, backend=b, env=ENV) for b in (ODC, REF)}


def _assert_rel_close(got, ref, base, tol, what):
    """Per tensor: |got - ref| <= tol * |base| (Frobenius norms)."""
    for name, r in ref.items():
        diff, scale = (torch.from_numpy(got[name]) - torch.from_numpy(r)).norm(), torch.as_tensor(base[name]).norm()
        assert scale > 0 and diff <= tol * scale, f"{what} {name}: |odc-nccl|={diff:.3g} vs {tol}*{scale:.3g}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_fsdp2_matches_nccl(runs, name):
    init = fm.init_params()
    for rank in range(N):
        got, ref = runs[ODC][rank]["configs"][name], runs[REF][rank]["configs"][name]
        what = f"{name} rank {rank}"
        if not CONFIGS[name].get("bf16"):
            fm.assert_runs_close(got, ref, **FP32_TOL, what=what)
            continue
        for key in ("losses", "norms"):
            torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(ref[key]), rtol=BF16_RTOL, atol=0,
                                       msg=lambda m: f"{what} {key}: {m}")
        _assert_rel_close(got["grads"], ref["grads"], ref["grads"], BF16_RTOL, f"{what} grad")
        updates = {n: torch.from_numpy(p) - init[n] for n, p in ref["params"].items()}
        _assert_rel_close(got["params"], ref["params"], updates, BF16_UPDATE_RTOL, f"{what} param")


def test_gpu_odc_backend_is_used(runs):
    for rank, res in runs[ODC].items():
        fm.assert_fsdp_used_odc(res["calls"], res["groups"], what=f"rank {rank}")
