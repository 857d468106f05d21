"""Decoupled mode: gradients after odc.sync equal exact-mode FSDP2 over the same global set
of microbatches, although ranks run different numbers of microbatches (zero included) with
random delays; misuse raises clear errors.

CPU ("cpu:odc"): one spawned job per world size runs every configuration (spawning is slow
on CI). CUDA ("cpu:gloo,cuda:odc", CUDA IPC arena): one job per configuration, with uneven
microbatch counts and delays; also CPU offload, int reshard_after_forward, a gradient divide
factor and a step GradScaler skips. With one GPU, 4 ranks share it."""
from __future__ import annotations

import random
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp_models as fm
from dist_utils import GPU_ENV, NVSHMEM_SUITE, cuda_case, run_distributed, run_once

STEPS = 3
SKIPPED_STEP = 1  # the step GradScaler skips in the "scaler" configurations
CONFIGS = {
    2: {"w2": dict(mesh=(2,)), "w2_bf16_params": dict(mesh=(2,), bf16=True),
        "w2_frozen_params": dict(mesh=(2,), frozen=True),
        "w2_local_accumulate": dict(mesh=(2,), bf16=True, accumulate="local"),
        "w2_noreshard": dict(mesh=(2,), reshard=False),
        "w2_divide_factor": dict(mesh=(2,), divide_factor=3.0),
        # GradScaler skips step SKIPPED_STEP (inf loss on every rank), as with fp16 overflow
        "w2_grad_scaler_skips_a_step": dict(mesh=(2,), scaler=True)},
    4: {"w4": dict(mesh=(4,)), "hsdp_2x2": dict(mesh=(2, 2), dims=("replicate", "shard")),
        "hsdp_2x2_local_accumulate": dict(mesh=(2, 2), dims=("replicate", "shard"), accumulate="local"),
        # odc.last_microbatch: the replicate all-reduces start in each rank's last backward
        "hsdp_2x2_last_microbatch": dict(mesh=(2, 2), dims=("replicate", "shard"), last_hint=True),
        # only even ranks announce: the others' sync takes each group once its shard group is done
        "hsdp_2x2_last_microbatch_even_ranks": dict(mesh=(2, 2), dims=("replicate", "shard"),
                                                    last_hint="even"),
        # backward all-gathers over groups of 2 ranks (the post-forward mesh)
        "w4_reshard2": dict(mesh=(4,), reshard=2),
        "hsdp_2x2_reshard_int_divide_factor": dict(mesh=(2, 2), dims=("replicate", "shard"),
                                                   reshard=2, divide_factor=8.0)},
}
# fp32 everywhere but the summation order of the gradient reduction (atomic adds vs rank
# order), so only reassociation differences; bf16 parameters move the same way up to
# the bf16 rounding of a master weight's copy.
TOL = {False: dict(rtol=1e-4, atol=1e-5), True: dict(rtol=2e-2, atol=2e-3)}
LOSS_SCALE = 0.25  # every microbatch's loss, in both modes: the global gradient is the same sum

# CUDA: N ranks (sharing the GPUs where there are fewer), one job per configuration
N = torch.cuda.device_count() if torch.cuda.device_count() >= 2 else 4  # ranks
GPU_CONFIGS = {"fp32_1d": dict(mesh=(N,)), "bf16_1d": dict(mesh=(N,), bf16=True),
               "bf16_1d_local_accumulate": dict(mesh=(N,), bf16=True, accumulate="local"),
               "fp32_1d_cpu_offload": dict(mesh=(N,), offload=True),
               "fp32_1d_divide_factor": dict(mesh=(N,), divide_factor=3.0),
               "fp32_1d_grad_scaler_skips_a_step": dict(mesh=(N,), scaler=True)}
if N >= 4 and N % 2 == 0:
    GPU_CONFIGS["bf16_hsdp"] = dict(mesh=(2, N // 2), dims=("replicate", "shard"), bf16=True)
    GPU_CONFIGS["bf16_hsdp_last_microbatch"] = dict(mesh=(2, N // 2), dims=("replicate", "shard"),
                                                    bf16=True, last_hint=True)
    GPU_CONFIGS["fp32_1d_reshard_to_2"] = dict(mesh=(N,), reshard=2)
if NVSHMEM_SUITE:  # peers over NVSHMEM: the owner-side put-accumulate is refused (test_nvshmem.py)
    for _cfg in GPU_CONFIGS.values():
        _cfg["accumulate"] = "local"
CASES = ([("cpu", w, n) for w in CONFIGS for n in CONFIGS[w]]
         + [cuda_case("cuda", N, n, id=f"cuda-{N}-{n}") for n in GPU_CONFIGS])


def _assignments(dp: int, step: int, uneven: bool) -> list[list[int]]:
    """Microbatch ids per data-parallel rank: 2 * dp microbatches per step."""
    ids = list(range(2 * dp))
    if not uneven:
        return [ids[2 * r:2 * r + 2] for r in range(dp)]
    # step-dependent rank gets half of everything, the next one none, the rest share
    heavy, idle = step % dp, (step + 1) % dp
    out = [[] for _ in range(dp)]
    out[heavy] = ids[:dp]
    rest = [r for r in range(dp) if r not in (heavy, idle)] or [heavy]
    for i, m in enumerate(ids[dp:]):
        out[rest[i % len(rest)]].append(m)
    return out


def _microbatch_loss(model, mb: int, step: int, device="cpu"):
    x, y = fm.batch(seed=7, dp_rank=mb, step=step, device=device)
    return F.cross_entropy(model(x).float(), y.reshape(-1)) * LOSS_SCALE


FROZEN = ("blocks.0.proj.bias", "blocks.1.fc1.weight")  # e.g. adapters-only fine-tuning


def _announces(last_hint, rank: int) -> bool:
    """Whether this rank calls odc.last_microbatch (last_hint: True, False or "even")."""
    return last_hint is True or (last_hint == "even" and rank % 2 == 0)


def _train(mesh, *, decoupled: bool, bf16: bool, delays: bool, device="cpu", frozen=False,
           accumulate="owner", reshard=True, divide_factor=None, scaler=False, offload=False,
           last_hint=False):
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy

    import torch_odc_backend as odc

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    model, opt = fm.build(mesh, seed=3, mp_policy=mp, device=device, reshard_after_forward=reshard,
                          offload_policy=CPUOffloadPolicy() if offload else None)
    if frozen:
        for name, p in model.named_parameters():
            p.requires_grad_(name not in FROZEN)
    if divide_factor is not None:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(divide_factor)
    grad_scaler = None
    if scaler:
        grad_scaler = torch.amp.GradScaler(device.split(":")[0], init_scale=2.0 ** 8)
        # GradScaler creates its scale in the first scale(): a rank that runs no microbatch
        # before its first step must call it once too (README, decoupled mode)
        grad_scaler.scale(torch.ones((), device=device))
    if decoupled:
        odc.decouple(model, opt, accumulate=accumulate)
    dp, rank = dist.get_world_size(), dist.get_rank()
    rng = random.Random(rank)
    grads, scales = [], []
    for step in range(STEPS):
        mine = _assignments(dp, step, uneven=decoupled)[rank]
        for i, mb in enumerate(mine):
            if decoupled and _announces(last_hint, rank) and i == len(mine) - 1:
                odc.last_microbatch(model)
            if delays:
                time.sleep(rng.uniform(0, 0.05))
            loss = _microbatch_loss(model, mb, step, device)
            if grad_scaler is not None:
                loss = grad_scaler.scale(loss * (float("inf") if step == SKIPPED_STEP else 1.0))
            loss.backward()
        if decoupled:
            odc.sync(model)
        if grad_scaler is not None and step == SKIPPED_STEP:
            grads.append({})  # inf / nan: compared through the skip itself
        else:
            grads.append({n: p.grad.full_tensor().float().cpu() / (grad_scaler.get_scale() if grad_scaler else 1)
                          if p.grad is not None else None for n, p in model.named_parameters()})
        if grad_scaler is not None:
            grad_scaler.step(opt)
            grad_scaler.update()
            scales.append(grad_scaler.get_scale())
        else:
            opt.step()
        opt.zero_grad()
    out = {"grads": grads, "params": fm.full_params(model), "scales": scales}
    if decoupled:
        out["metrics"] = odc.metrics(model)
    return out


def _misuse(mesh):
    """Each misuse raises a clear error (returned as text, or None when nothing was raised)."""
    import torch_odc_backend as odc

    out = {}
    model, opt = fm.build(mesh, seed=5)
    odc.decouple(model, opt)
    _microbatch_loss(model, 0, 0).backward()

    def expect(name, fn):
        try:
            fn()
            out[name] = None
        except (RuntimeError, ValueError) as e:
            out[name] = str(e)

    expect("step_without_sync", opt.step)
    odc.sync(model)
    opt.step()
    opt.zero_grad()
    expect("decouple_twice", lambda: odc.decouple(model, opt))
    from torch.distributed.device_mesh import init_device_mesh
    flat, flat_opt = fm.build(init_device_mesh("cpu", (2, 1), mesh_dim_names=("r", "s")), seed=5)
    expect("shard_size_1", lambda: odc.decouple(flat, flat_opt))
    other, other_opt = fm.build(mesh, seed=5)
    expect("bad_accumulate_mode", lambda: odc.decouple(other, other_opt, accumulate="remote"))
    # the profiler shows the one-sided operations and the sync
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _microbatch_loss(model, 2, 1).backward()
        odc.sync(model)
    out["profiled"] = sorted({e.name for e in prof.events() if e.name.startswith("odc.")})
    opt.step()
    opt.zero_grad()
    with torch.no_grad():  # weights edited behind the published shards' back
        next(model.parameters()).to_local().mul_(2)
    expect("stale_published_shards", lambda: _microbatch_loss(model, 3, 2).backward())
    expect("unusable_after_error", lambda: odc.sync(model))
    return out


def _zero_outputs(mesh):
    """FSDP2's reduce-scatter outputs (the .grad views until sync) share one zero buffer:
    facts for test_reduce_scatter_outputs_share_one_zero_buffer."""
    import torch_odc_backend as odc

    out = {}
    models = {how: fm.build(mesh, seed=11) for how in ("none", "zeros")}
    for model, opt in models.values():
        odc.decouple(model, opt)
    grads = {}
    for step in range(3):
        for how, (model, opt) in models.items():
            for mb in range(2):
                _microbatch_loss(model, mb, step).backward()
            if step == 0:  # before sync: every trainable .grad views the same storage
                out["storages_before_sync"] = len({p.grad.to_local().untyped_storage().data_ptr()
                                                   for p in model.parameters()})
                out["grads_before_sync"] = len([p for p in model.parameters() if p.grad is not None])
                out["nonzero_before_sync"] = sum(int(p.grad.to_local().count_nonzero())
                                                 for p in model.parameters())
            odc.sync(model)
            grads[how] = [p.grad.to_local().clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=(how == "none"))  # "zeros": sync adds into kept .grad
        out[f"equal_step{step}"] = all(torch.allclose(a, b, **TOL[False])  # atomic adds: any order
                                       for a, b in zip(grads["none"], grads["zeros"]))
    model, opt = models["none"]
    _microbatch_loss(model, 0, 3).backward()
    with torch.no_grad():  # a gradient edited during the minibatch: it would reach every group
        next(model.parameters()).grad.to_local().add_(1.0)
    try:
        odc.sync(model)
        out["edited"] = None
    except RuntimeError as e:
        out["edited"] = str(e)
    opt.zero_grad()
    _microbatch_loss(model, 1, 4).backward()
    odc.sync(model)  # the buffer is zero again: the next minibatch syncs as usual
    out["after_edit_finite"] = all(bool(p.grad.to_local().isfinite().all()) for p in model.parameters())
    return out


def _freed_worker(rank, world):
    """A decoupled model, its optimizer and its local buffers are freed once dropped."""
    import gc
    import weakref

    import torch_odc_backend as odc
    from torch.distributed.device_mesh import init_device_mesh

    model, opt = fm.build(init_device_mesh("cpu", (world,)), seed=5)
    odc.decouple(model, opt, accumulate="local")
    _microbatch_loss(model, 0, 0).backward()
    odc.sync(model)
    opt.step()
    opt.zero_grad()
    ref = weakref.ref(model)
    del model, opt
    gc.collect()
    return ref() is None


def test_decoupled_model_is_freed_when_dropped():
    assert run_distributed(_freed_worker, 2, backend="cpu:odc", deadline_s=120) == {0: True, 1: True}


def _gloo_mesh_worker(rank, world):
    import torch_odc_backend as odc
    from torch.distributed.device_mesh import init_device_mesh

    model, opt = fm.build(init_device_mesh("cpu", (world,)), seed=5)
    try:
        odc.decouple(model, opt)
    except ValueError as e:
        return str(e)
    return None


def run_configs(configs, device="cpu"):
    """Exact and decoupled training per configuration: {name: {"exact", "decoupled"} or
    {"error"}}, and the meshes made for them."""
    from torch.distributed.device_mesh import init_device_mesh

    meshes, out = {}, {}
    for name, cfg in configs.items():
        key = (cfg["mesh"], cfg.get("dims"))
        if key not in meshes:
            meshes[key] = init_device_mesh(device, key[0], mesh_dim_names=key[1])
        try:
            kw = dict(bf16=cfg.get("bf16", False), device=device, frozen=cfg.get("frozen", False),
                      reshard=cfg.get("reshard", True), divide_factor=cfg.get("divide_factor"),
                      scaler=cfg.get("scaler", False), offload=cfg.get("offload", False),
                      last_hint=cfg.get("last_hint", False))
            out[name] = {"exact": _train(meshes[key], decoupled=False, delays=False, **kw),
                         "decoupled": _train(meshes[key], decoupled=True, delays=True,
                                             accumulate=cfg.get("accumulate", "owner"), **kw)}
        except Exception:  # report per configuration; the others still run
            out[name] = {"error": traceback.format_exc()}
    return out, meshes


def _worker(rank, world, configs):
    out, meshes = run_configs(configs)
    if world == 2:
        for key, fn in (("misuse", _misuse), ("zero_outputs", _zero_outputs)):
            try:
                out[key] = fn(meshes[((2,), None)])
            except Exception:
                out[key] = {"error": traceback.format_exc()}
    return fm.to_wire(out)


def assert_grads_match(cfg, tol, rank):
    """After every sync, decoupled mode's gradients equal exact mode's (frozen: none)."""
    for step in range(STEPS):
        for pname, ref in cfg["exact"]["grads"][step].items():
            got = cfg["decoupled"]["grads"][step][pname]
            if ref is None:  # frozen
                assert got is None, f"rank {rank} step {step}: frozen {pname} got a gradient"
                continue
            assert got is not None, f"rank {rank} step {step}: {pname} has no gradient after sync"
            torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(ref), **tol,
                                       msg=lambda m: f"rank {rank} step {step} grad {pname}: {m}")


def _gpu_worker(rank, world, name):
    torch.cuda.set_device(rank % torch.cuda.device_count())
    return fm.to_wire(run_configs({name: GPU_CONFIGS[name]}, "cuda")[0])


@pytest.fixture(scope="module")
def run():
    return run_once(lambda world: run_distributed(_worker, world, CONFIGS[world], backend="cpu:odc",
                                                  deadline_s=300))


# CUDA: one job per configuration: a failure in one cannot leave another's group broken
gpu_run = run_once(lambda name: run_distributed(_gpu_worker, N, name, backend="cpu:gloo,cuda:odc",
                                                env=GPU_ENV, deadline_s=400))


@pytest.mark.parametrize("device,world,name", CASES)
def test_decoupled_equals_exact(run, device, world, name):
    res = run(world) if device == "cpu" else gpu_run(name)
    bf16 = (CONFIGS[world] if device == "cpu" else GPU_CONFIGS)[name].get("bf16", False)
    errors = [f"rank {r}:\n{res[r][name]['error']}" for r in sorted(res) if "error" in res[r][name]]
    assert not errors, "\n".join(errors)
    configs = CONFIGS[world] if device == "cpu" else GPU_CONFIGS
    for rank in sorted(res):
        cfg = res[rank][name]
        assert_grads_match(cfg, TOL[bf16], rank)
        if _announces(configs[name].get("last_hint", False), rank):  # it ran microbatches in some step
            assert cfg["decoupled"]["metrics"]["early_all_reduces"] > 0, cfg["decoupled"]["metrics"]
        if device == "cuda":  # there the gradients after every sync are checked
            continue
        exact, dec = cfg["exact"], cfg["decoupled"]
        tol = TOL[bf16]
        for pname, ref in exact["params"].items():
            torch.testing.assert_close(torch.as_tensor(dec["params"][pname]), torch.as_tensor(ref),
                                       **tol, msg=lambda m: f"rank {rank} param {pname}: {m}")
        m = dec["metrics"]
        assert m["minibatches"] == STEPS and m["busy_s"] > 0 and 0 <= m["bubble_rate"] < 1, m
        scaler = CONFIGS[world][name].get("scaler", False)
        assert m["skipped_steps"] == (1 if scaler else 0), m
        assert list(dec["scales"]) == list(exact["scales"]), (dec["scales"], exact["scales"])
        if scaler:  # the skip halved the scale; the other steps left it alone
            assert exact["scales"] == [2.0 ** 8, 2.0 ** 7, 2.0 ** 7], exact["scales"]


@pytest.mark.parametrize("case,pattern", [
    ("step_without_sync", "without odc.sync"),
    ("decouple_twice", "already"),
    ("shard_size_1", "at least 2 ranks"),
    ("bad_accumulate_mode", "accumulate must be 'owner' or 'local'"),
    ("stale_published_shards", "changed in place after optimizer.step() published it"),
    ("unusable_after_error", "unusable after an earlier error"),
    ("unusable_after_error", "odc.sync cannot run"),  # names the call refused
])
def test_misuse_is_reported(run, case, pattern):
    res = run(2)
    for rank in sorted(res):
        m = res[rank]["misuse"]
        assert "error" not in m, f"rank {rank}:\n{m.get('error')}"
        assert m[case] is not None, f"rank {rank}: {case} raised nothing"
        assert pattern in m[case], f"rank {rank}: {case}: {m[case]}"


def test_reduce_scatter_outputs_share_one_zero_buffer(run):
    """Until sync, FSDP2's .grad views one zero buffer for every group (not a gradient's
    worth of zeros beside the accumulators); sync replaces them, adds into .grad that
    zero_grad(set_to_none=False) kept, and refuses a gradient edited during the minibatch."""
    res = run(2)
    for rank in sorted(res):
        z = res[rank]["zero_outputs"]
        assert "error" not in z, f"rank {rank}:\n{z.get('error')}"
        assert z["grads_before_sync"] > 4 and z["storages_before_sync"] == 1, z
        assert z["nonzero_before_sync"] == 0, z
        assert all(z[f"equal_step{s}"] for s in range(3)), z
        assert z["edited"] is not None and "written during backward" in z["edited"], z
        assert z["after_edit_finite"], z


def test_early_reduction_order_is_backwards_and_skips_frozen_groups():
    """odc.last_microbatch's all-reduce order, the same on every rank: a group FSDP2 never
    reduce-scatters (nothing trainable) would otherwise hold back every group after it."""
    from types import SimpleNamespace

    from torch_odc_backend.decoupled import reduction_order

    groups = [SimpleNamespace(index=i, grad_numel=n) for i, n in enumerate([5, 0, 3, 7])]
    assert reduction_order(groups) == [3, 2, 0]


def test_decouple_refuses_a_non_odc_mesh():
    res = run_distributed(_gloo_mesh_worker, 2, backend="gloo", deadline_s=120)
    for rank in sorted(res):
        assert res[rank] is not None, f"rank {rank}: odc.decouple accepted a gloo mesh"
        assert "not odc" in res[rank], res[rank]


def test_profiler_shows_gets_puts_and_sync(run):
    res = run(2)
    for rank in sorted(res):
        assert res[rank]["misuse"]["profiled"] == ["odc.get", "odc.put_accumulate", "odc.sync"], \
            res[rank]["misuse"]["profiled"]


def _arena_size_worker(rank, world):
    import torch_odc_backend as odc
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch_odc_backend import nvshmem as odc_nvshmem
    from torch_odc_backend.decoupled import arena_bytes

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model, opt = fm.build(init_device_mesh("cpu", (world,)), seed=5, mp_policy=mp)
    predicted = {a: arena_bytes(model, a) for a in ("owner", "local")}
    try:
        arena_bytes(model, "Owner")
        refused = False
    except ValueError:
        refused = True
    slab = odc_nvshmem.slab_bytes_for(model)
    state = odc.decouple(model, opt)
    made = state.arena.size()  # what the backend laid out
    n_shard = sum(g.numel for g in state.groups)
    return predicted, made, n_shard, slab, odc_nvshmem.default_slab_bytes(world, groups=2), refused


def test_arena_and_slab_sizes_are_what_decouple_registers():
    """arena_bytes(model) (for sizing NVSHMEM's slab before any group exists) equals the arena
    odc.decouple creates: bf16 published shards plus fp32 accumulators ("owner"), or the
    shards alone ("local"); slab_bytes_for adds two windows (world group, one mesh dimension)."""
    res = run_distributed(_arena_size_worker, 2, backend="cpu:odc", deadline_s=120)
    for rank, (predicted, made, n_shard, slab, two_windows, refused) in res.items():
        assert refused, "arena_bytes accepted accumulate='Owner'"
        assert predicted["owner"] == made, (rank, predicted, made)
        assert 2 * n_shard <= predicted["local"] < 2 * n_shard + 64 * 1024, (rank, predicted, n_shard)
        assert predicted["owner"] >= predicted["local"] + 4 * (n_shard // 2), (rank, predicted)
        assert slab == two_windows + (predicted["local"] + 4095) // 4096 * 4096, (rank, slab)


# ---- parameters changed or replaced after odc.decouple
#
# Each scenario trains STEPS minibatches from fm.build(seed=3) with one change made to the
# model, at one point: "start" (after odc.decouple, before the first forward), "reload" (after
# the first minibatch's sync, in place of its optimizer step), "after_step" (after the first
# optimizer step) or "mid" (after the first microbatch's backward). The changes load the
# weights of a model built with another seed.
def _change_model(change: str, model, src_sd: dict, ckpt_dir: str) -> None:
    if change == "load_in_place":  # copies into the parameters; FSDP2's post-load hook re-checks them
        model.load_state_dict(src_sd)
    elif change == "dcp_load":  # DCP copies into the state dict's tensors: the parameters' shards
        import torch.distributed.checkpoint as dcp

        dcp.load({"model": model.state_dict()}, checkpoint_id=ckpt_dir)
    elif change == "copy_no_grad":
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(src_sd[name])
    elif change == "swap_storage":  # nn.Module._apply: new local shards under the same Parameters
        model.to(torch.bfloat16).to(torch.float32)
    elif change == "to_float64":  # another dtype than the published shards'
        model.to(torch.float64)
    elif change == "assign":  # new Parameter objects (FSDP2 takes them in its post-load hook)
        model.load_state_dict({k: v.detach().clone() for k, v in src_sd.items()}, assign=True)
    elif change == "module_attr":  # a new Parameter FSDP2 does not know
        model.blocks[1].fc1.weight = torch.nn.Parameter(src_sd["blocks.1.fc1.weight"].detach().clone())
    else:
        raise ValueError(change)


def _train_with_change(mesh, *, decoupled: bool, change: str, at: str, src_sd, ckpt_dir):
    import torch_odc_backend as odc

    model, opt = fm.build(mesh, seed=3)
    if decoupled:
        odc.decouple(model, opt)
    if at == "start":
        _change_model(change, model, src_sd, ckpt_dir)
    dp, rank = dist.get_world_size(), dist.get_rank()
    # the refused changes run the same microbatches on every rank, so that every rank raises
    uneven = decoupled and at in ("start", "reload")
    grads = []
    for step in range(STEPS):
        for i, mb in enumerate(_assignments(dp, step, uneven)[rank]):
            _microbatch_loss(model, mb, step).backward()
            if at == "mid" and step == 0 and i == 0:
                _change_model(change, model, src_sd, ckpt_dir)
        if decoupled:
            odc.sync(model)
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        if at == "reload" and step == 0:  # a checkpoint loaded instead of this minibatch's step
            _change_model(change, model, src_sd, ckpt_dir)
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
        if at == "after_step" and step == 0:
            _change_model(change, model, src_sd, ckpt_dir)
    return {"grads": grads, "params": fm.full_params(model)}


# changes decoupled mode follows as exact mode does
CHANGES_EQUAL = [("load_in_place", "start"), ("dcp_load", "start"), ("copy_no_grad", "start"),
                 ("swap_storage", "start"), ("load_in_place", "reload")]
# changes refused with a clear error: (change, at, what the message says)
CHANGES_REFUSED = [
    ("assign", "start", ["'tok.weight'", "replaced", "assign=True", "before"]),
    ("assign", "after_step", ["'tok.weight'", "replaced", "assign=True"]),
    ("module_attr", "after_step", ["'blocks.1.fc1.weight'", "replaced", "FSDP2"]),
    ("load_in_place", "after_step", ["'tok.weight'", "changed in place", "after", "optimizer.step"]),
    ("swap_storage", "after_step", ["'tok.weight'", "storage"]),
    ("to_float64", "start", ["'tok.weight'", "dtype", "torch.float64"]),
    ("copy_no_grad", "mid", ["'tok.weight'", "during the minibatch"]),
]


def _changes_worker(rank, world, ckpt_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    src, _ = fm.build(mesh, seed=11)
    src_sd = src.state_dict()
    dcp.save({"model": src_sd}, checkpoint_id=ckpt_dir)
    out = {}
    for change, at in CHANGES_EQUAL:
        try:
            out[f"{change}@{at}"] = {
                mode: _train_with_change(mesh, decoupled=mode == "decoupled", change=change, at=at,
                                         src_sd=src_sd, ckpt_dir=ckpt_dir)
                for mode in ("exact", "decoupled")}
        except Exception:
            out[f"{change}@{at}"] = {"error": traceback.format_exc()}
    for change, at, _ in CHANGES_REFUSED:  # after the others: each leaves its model unusable
        try:
            _train_with_change(mesh, decoupled=True, change=change, at=at, src_sd=src_sd,
                               ckpt_dir=ckpt_dir)
            out[f"{change}@{at}"] = None
        except Exception as e:  # noqa: BLE001 - the message is checked
            out[f"{change}@{at}"] = f"{type(e).__name__}: {e}"
    return fm.to_wire(out)


def _launch_changes():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return run_distributed(_changes_worker, 2, f"{tmp}/ckpt", backend="cpu:odc", deadline_s=120)


changes_run = run_once(_launch_changes)


def _assert_equal_to_exact(res, key):
    for rank in sorted(res):
        r = res[rank][key]
        assert "error" not in r, f"rank {rank} {key}:\n{r.get('error')}"
        for step in range(STEPS):
            for pname, ref in r["exact"]["grads"][step].items():
                torch.testing.assert_close(
                    torch.as_tensor(r["decoupled"]["grads"][step][pname]), torch.as_tensor(ref),
                    **TOL[False], msg=lambda m: f"rank {rank} {key} step {step} grad {pname}: {m}")
        for pname, ref in r["exact"]["params"].items():
            torch.testing.assert_close(torch.as_tensor(r["decoupled"]["params"][pname]),
                                       torch.as_tensor(ref), **TOL[False],
                                       msg=lambda m: f"rank {rank} {key} param {pname}: {m}")


def _assert_refused(res, change, at):
    pattern = next(p for c, a, p in CHANGES_REFUSED if (c, a) == (change, at))
    for rank in sorted(res):
        msg = res[rank][f"{change}@{at}"]
        assert msg is not None, f"rank {rank}: {change} at {at} raised nothing"
        for part in pattern:
            assert part in msg, f"rank {rank}: {change} at {at}: {part!r} not in: {msg}"


@pytest.mark.parametrize("change,at", [("load_in_place", "start"), ("dcp_load", "start"),
                                       ("copy_no_grad", "start"), ("load_in_place", "reload")])
def test_in_place_loads_after_decouple_equal_exact_mode(change, at):
    """A checkpoint loaded in place after odc.decouple (before the first forward, or after a
    sync in place of its optimizer step) is what every rank gathers next, as in exact mode."""
    _assert_equal_to_exact(changes_run(), f"{change}@{at}")


@pytest.mark.parametrize("change,at", [("load_in_place", "after_step"), ("copy_no_grad", "mid")])
def test_in_place_changes_after_publishing_are_refused(change, at):
    """After the optimizer step published this rank's shards (or during a minibatch) peers may
    have gathered them already: an in-place change there is refused, not gathered stale."""
    _assert_refused(changes_run(), change, at)


@pytest.mark.parametrize("change,at", [("assign", "start"), ("assign", "after_step"),
                                       ("module_attr", "after_step")])
def test_replaced_parameters_are_refused(change, at):
    """load_state_dict(assign=True) or a module attribute assignment after odc.decouple: the
    optimizer and the published shards belong to the old Parameters; a clear error names the
    parameter instead of gathering the stale copy and writing .grad to the old objects."""
    _assert_refused(changes_run(), change, at)


def test_swapped_parameter_storage():
    """New local shards under the same Parameters (nn.Module._apply, e.g. model.to(): for
    DTensor parameters the form `param.data = ...` takes; a plain `.data =` leaves a DTensor's
    local shard alone): before the first forward they are what is published (equal to exact
    mode); after a step, refused; another dtype, refused."""
    res = changes_run()
    _assert_equal_to_exact(res, "swap_storage@start")
    _assert_refused(res, "swap_storage", "after_step")
    _assert_refused(res, "to_float64", "start")  # not the published shards' dtype
