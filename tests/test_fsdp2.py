"""FSDP2 training under odc must train as the stock backend does, per device.

CPU ("cpu:odc"): as gloo. Spawning costs seconds on the 2-core CI box, so every
configuration of one world size runs inside a single spawned job per backend (4 jobs in
all); the jobs run lazily, once per module, and each test compares its configuration's results.

CUDA ("cpu:gloo,cuda:odc"): as NCCL, or, where the ranks share GPUs (NCCL refuses that; one
GPU: 4 ranks on it), as the single-process reference does (fsdp_models.reference_train,
checked against gloo's FSDP2 here). The same training with init_process_group(device_id=...)
(DeviceMesh then splits its groups from the default one) must give bitwise the same results.
"""
from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist

import fsdp_models as fm
from dist_utils import GPU_ENV, cuda_case, gpu_test, ranks_share_gpus, run_distributed, run_once

HSDP = dict(mesh=(2, 2), dims=("replicate", "shard"))
ACCUM_CLIP = dict(grad_accum=2, clip_norm=0.05)  # 0.05 is well below the grad norm: clipping is active
CONFIGS = {
    2: {
        "w2": dict(mesh=(2,)),
        "w2_noreshard_accum_clip": dict(mesh=(2,), reshard_after_forward=False, **ACCUM_CLIP),
        "w2_dcp": dict(mesh=(2,), dcp=True),
        "w2_bf16": dict(mesh=(2,), bf16=True),  # MixedPrecisionPolicy(bfloat16, float32)
    },
    4: {
        "w4": dict(mesh=(4,)),
        # int: reshard to groups of 2 after forward; backward all-gathers in those subgroups
        "w4_reshard2_accum_clip": dict(mesh=(4,), reshard_after_forward=2, **ACCUM_CLIP),
        "hsdp_2x2": dict(HSDP),
        "hsdp_2x2_noreshard_accum_clip": dict(HSDP, reshard_after_forward=False, **ACCUM_CLIP),
    },
}
ODC, REF = "cpu:odc", "gloo"
# fp32, same ops in the same order except inside the reduction. With 2 ranks a+b is
# commutative, so results are expected bitwise equal; with 4 ranks the summation
# order of a reduce-scatter may differ from gloo's by a few ulp per gradient element.
# CUDA: as on CPU, only the summation order inside a reduction may differ.
RTOL, ATOL = 1e-5, 1e-6

# CUDA: one job of N ranks per run (odc, odc with device_id, NCCL where it can run)
N = torch.cuda.device_count() if torch.cuda.device_count() >= 2 else 4  # ranks
SHARED = ranks_share_gpus(N)
GPU_CONFIGS = {
    "bf16_1d": dict(mesh=(N,), bf16=True),
    "fp32_1d_noreshard_accum_clip": dict(mesh=(N,), reshard_after_forward=False, grad_accum=2, clip_norm=0.05),
}
if N >= 4 and N % 2 == 0:
    GPU_HSDP = dict(mesh=(2, N // 2), dims=("replicate", "shard"))
    GPU_CONFIGS.update(bf16_hsdp=dict(GPU_HSDP, bf16=True), fp32_hsdp=dict(GPU_HSDP, grad_accum=2))
GPU_ODC, NCCL = "cpu:gloo,cuda:odc", "nccl"
GPU_TEST_ENV = dict(GPU_ENV, CUBLAS_WORKSPACE_CONFIG=":4096:8")


def _configs(device):
    return CONFIGS if device == "cpu" else {N: GPU_CONFIGS}


# (device, world, name) of the training configurations (DCP is checked on CPU only)
CASES = ([("cpu", w, n) for w, cs in CONFIGS.items() for n in cs if "dcp" not in n]
         + [cuda_case("cuda", N, n, id=f"cuda-{N}-{n}") for n in GPU_CONFIGS])


def _dcp_round_trip(mesh, ckpt_dir, seed=0, steps=2, **kw):
    """Train, save model+optim with DCP, load into a differently seeded model, continue both."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    a, opt_a = fm.build(mesh, seed=seed, **kw)
    fm.run_steps(a, opt_a, seed=seed, steps=steps)
    msd, osd = get_state_dict(a, opt_a)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)
    b, opt_b = fm.build(mesh, seed=seed + 1, **kw)
    msd, osd = get_state_dict(b, opt_b)  # also materialises b's (empty) optimizer state
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(b, opt_b, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out = {}
    for tag, (m, o) in {"orig": (a, opt_a), "loaded": (b, opt_b)}.items():
        out[tag] = {**fm.run_steps(m, o, seed=seed, start=steps, steps=1), "params": fm.full_params(m)}
    return out


def _worker(rank, world, configs, ckpt_dir):
    from torch.distributed.device_mesh import init_device_mesh

    meshes, out = {}, {}
    with fm.CallSpy() as spy:
        for name, cfg in configs.items():
            cfg = dict(cfg)
            key = (cfg.pop("mesh"), cfg.pop("dims", None))
            if key not in meshes:
                meshes[key] = init_device_mesh("cpu", key[0], mesh_dim_names=key[1])
            if cfg.pop("bf16", False):
                from torch.distributed.fsdp import MixedPrecisionPolicy

                cfg["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                        reduce_dtype=torch.float32)
            try:
                if cfg.pop("dcp", False):
                    out[name] = _dcp_round_trip(meshes[key], f"{ckpt_dir}/{name}", **cfg)
                else:
                    out[name] = fm.train(meshes[key], **cfg)
            except Exception:  # report per configuration; the other ones still run
                out[name] = {"error": traceback.format_exc()}
    return fm.to_wire({"configs": out, "calls": dict(spy.calls), "groups": fm.group_report(spy),
                       "default_backend": dist.get_backend()})


def _gpu_worker(rank, world, configs, with_reference):
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
def run(tmp_path_factory):
    """run(world, backend) -> {rank: worker result}; each job runs once, failures are cached too.
    CUDA: backend "odc", "odc_device_id" or "nccl", world N."""
    def launch(world, backend):
        if backend in ("odc", "odc_device_id", "nccl"):
            return run_distributed(_gpu_worker, N, GPU_CONFIGS, backend == "odc" and SHARED,
                                   backend=NCCL if backend == "nccl" else GPU_ODC, env=GPU_TEST_ENV,
                                   device_id=backend == "odc_device_id")
        ckpt = tmp_path_factory.mktemp(f"dcp_w{world}_{backend.replace(':', '_')}")
        return run_distributed(_worker, world, CONFIGS[world], str(ckpt), backend=backend,
                               deadline_s=240)

    return run_once(launch)


def _config(run, world, backend, name, rank):
    res = run(world, backend)[rank]["configs"][name]
    assert "error" not in res, f"{backend} rank {rank} {name}:\n{res['error']}"
    return res


def _odc_and_reference(run, device, world, name, rank):
    """odc's result and the one it must match: gloo's (CPU); NCCL's, or the single-process
    reference's where the ranks share GPUs (CUDA)."""
    if device == "cpu":
        return _config(run, world, ODC, name, rank), _config(run, world, REF, name, rank), REF
    got = _config(run, world, "odc", name, rank)
    if not SHARED:
        return got, _config(run, world, "nccl", name, rank), "nccl"
    return got, run(world, "odc")[0]["reference"][name][rank], "single-process reference"


@pytest.mark.parametrize("device,world,name", CASES)
def test_fsdp2_matches_reference(run, device, world, name):
    cfg = _configs(device)[world][name]
    for rank in range(world):
        got, ref, against = _odc_and_reference(run, device, world, name, rank)
        what = f"{name} rank {rank} vs {against}"
        if cfg.get("bf16") and device == "cuda":  # NCCL / the reference round differently
            fm.assert_bf16_runs_close(got, ref, what=what)
        else:
            fm.assert_runs_close(got, ref, rtol=RTOL, atol=ATOL, what=what)
    if device == "cuda":
        return
    # The comparison is only meaningful if ranks saw different data (so the
    # reduction actually mixes contributions) and training moved the loss.
    losses = [_config(run, world, ODC, name, r)["losses"] for r in range(world)]
    assert len({tuple(l) for l in losses}) == world
    assert all(len(set(l)) > 1 for l in losses)
    if cfg.get("clip_norm"):
        assert all(n > cfg["clip_norm"] for n in ref["norms"])


def test_dcp_round_trip(run):
    world, name = 2, "w2_dcp"
    for rank in range(world):
        got = _config(run, world, ODC, name, rank)
        ref = _config(run, world, REF, name, rank)
        # Continuing from the checkpoint must reproduce continuing the original exactly.
        fm.assert_runs_close(got["loaded"], got["orig"], rtol=0, atol=0, what=f"odc loaded-vs-orig rank {rank}")
        fm.assert_runs_close(got["orig"], ref["orig"], rtol=RTOL, atol=ATOL, what=f"odc-vs-gloo rank {rank}")


@pytest.mark.parametrize("device,world", [("cpu", w) for w in sorted(CONFIGS)]
                         + [cuda_case("cuda", N, id=f"cuda-{N}")])
def test_odc_backend_is_used(run, device, world):
    if device == "cuda":
        for backend in ("odc", "odc_device_id"):
            for rank, res in run(world, backend).items():
                fm.assert_fsdp_used_odc(res["calls"], res["groups"], what=f"{backend} rank {rank}")
        return
    for rank, res in run(world, ODC).items():
        assert "odc" in res["default_backend"] or "custom" in res["default_backend"], res["default_backend"]
        fm.assert_fsdp_used_odc(res["calls"], res["groups"], what=f"rank {rank}")


@gpu_test()
@pytest.mark.parametrize("name", list(GPU_CONFIGS))
def test_gpu_fsdp2_with_device_id_is_bitwise_the_same(run, name):
    for rank in range(N):
        fm.assert_runs_close(_config(run, N, "odc_device_id", name, rank), _config(run, N, "odc", name, rank),
                             rtol=0, atol=0, what=f"{name} rank {rank} device_id vs not")


@pytest.mark.parametrize("world,name", [(w, n) for w, cs in CONFIGS.items() for n in cs if "dcp" not in n])
def test_single_process_reference_equals_fsdp2(run, world, name):
    """fsdp_models.reference_train (what the GPU tests compare with where NCCL cannot run:
    ranks sharing a GPU) reproduces FSDP2's training: checked here against gloo's."""
    cfg = CONFIGS[world][name]
    ref = fm.reference_train(world, **{k: cfg[k] for k in ("grad_accum", "clip_norm", "bf16") if k in cfg})
    for rank in range(world):
        got, what = _config(run, world, REF, name, rank), f"reference vs gloo {name} rank {rank}"
        if cfg.get("bf16"):
            fm.assert_bf16_runs_close(got, ref[rank], what=what)
        else:
            fm.assert_runs_close(got, ref[rank], rtol=RTOL, atol=ATOL, what=what)
