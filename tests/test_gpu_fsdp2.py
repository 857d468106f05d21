"""FSDP2 training on GPUs under "cpu:gloo,cuda:odc" must train as NCCL does, or, where the ranks
share GPUs (NCCL refuses that; one GPU: 4 ranks on it), as the single-process reference
does (fsdp_models.reference_train, checked against gloo's FSDP2 in tests/test_fsdp2.py).
The same training with init_process_group(device_id=...) (DeviceMesh then splits its
groups from the default one) must give bitwise the same results."""
from __future__ import annotations

import pytest
import torch

import fsdp_models as fm
from dist_utils import GPU_ENV, ranks_share_gpus, run_distributed

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")

N = torch.cuda.device_count() if torch.cuda.device_count() >= 2 else 4  # ranks
SHARED = ranks_share_gpus(N)
CONFIGS = {
    "bf16_1d": dict(mesh=(N,), bf16=True),
    "fp32_1d_noreshard_accum_clip": dict(mesh=(N,), reshard_after_forward=False, grad_accum=2, clip_norm=0.05),
}
if N >= 4 and N % 2 == 0:
    HSDP = dict(mesh=(2, N // 2), dims=("replicate", "shard"))
    CONFIGS.update(bf16_hsdp=dict(HSDP, bf16=True), fp32_hsdp=dict(HSDP, grad_accum=2))
ODC, NCCL = "cpu:gloo,cuda:odc", "nccl"
ENV = dict(GPU_ENV, CUBLAS_WORKSPACE_CONFIG=":4096:8")
# fp32: as on CPU, only the summation order inside a reduction may differ.
FP32_TOL = dict(rtol=1e-5, atol=1e-6)


def _worker(rank, world, configs, with_reference):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.cuda.set_device(rank % torch.cuda.device_count())  # the harness does so only for "cuda" backends
    device = torch.device("cuda", torch.cuda.current_device())
    # Same kernels in every run, so only the collectives can make them differ.
    torch.use_deterministic_algorithms(True, warn_only=True)
    meshes, out, ref = {}, {}, {}
    with fm.CallSpy() as spy, sdpa_kernel(SDPBackend.MATH):
        for name, cfg in configs.items():
            cfg = dict(cfg)
            key = (cfg.pop("mesh"), cfg.pop("dims", None))
            if key not in meshes:
                meshes[key] = init_device_mesh("cuda", key[0], mesh_dim_names=key[1])
            bf16 = cfg.pop("bf16", False)
            if bf16:
                cfg["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            out[name] = fm.train(meshes[key], device=device, **cfg)
            if with_reference and rank == 0:
                kw = {k: cfg[k] for k in ("grad_accum", "clip_norm") if k in cfg}
                ref[name] = fm.reference_train(world, bf16=bf16, device=device, **kw)
    torch.cuda.synchronize()
    return fm.to_wire({"configs": out, "reference": ref, "calls": dict(spy.calls),
                       "groups": fm.group_report(spy, "cuda")})


@pytest.fixture(scope="module")
def runs():
    out = {"odc": run_distributed(_worker, N, CONFIGS, SHARED, backend=ODC, env=ENV),
           "odc_device_id": run_distributed(_worker, N, CONFIGS, False, backend=ODC, env=ENV,
                                            device_id=True)}
    if not SHARED:
        out["nccl"] = run_distributed(_worker, N, CONFIGS, False, backend=NCCL, env=ENV)
    return out


def _reference(runs, name, rank):
    return runs["nccl"][rank]["configs"][name] if "nccl" in runs else runs["odc"][0]["reference"][name][rank]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_fsdp2_matches_nccl_or_reference(runs, name):
    for rank in range(N):
        got, ref = runs["odc"][rank]["configs"][name], _reference(runs, name, rank)
        what = f"{name} rank {rank} vs {'nccl' if 'nccl' in runs else 'single-process reference'}"
        if CONFIGS[name].get("bf16"):
            fm.assert_bf16_runs_close(got, ref, what=what)
        else:
            fm.assert_runs_close(got, ref, **FP32_TOL, what=what)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_fsdp2_with_device_id_is_bitwise_the_same(runs, name):
    for rank in range(N):
        fm.assert_runs_close(runs["odc_device_id"][rank]["configs"][name], runs["odc"][rank]["configs"][name],
                             rtol=0, atol=0, what=f"{name} rank {rank} device_id vs not")


def test_gpu_odc_backend_is_used(runs):
    for run in ("odc", "odc_device_id"):
        for rank, res in runs[run].items():
            fm.assert_fsdp_used_odc(res["calls"], res["groups"], what=f"{run} rank {rank}")
