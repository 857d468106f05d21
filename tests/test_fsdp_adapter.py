"""The FSDP2 adapter (the only reader of FSDP2 internals): what it reads for a known model,
and its refusal of torch versions it was not checked against."""
from __future__ import annotations

import pytest
import torch

import fsdp_models as fm
from dist_utils import run_distributed
from torch_odc_backend import _fsdp_adapter


def test_unchecked_torch_versions_are_refused():
    _fsdp_adapter._check_version("2.13.0+cpu")
    _fsdp_adapter._check_version("2.11.0+cu130")
    with pytest.raises(RuntimeError, match="checked on torch"):
        _fsdp_adapter._check_version("2.99.0")


def _policy_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model, _ = fm.build(mesh, mp_policy=mp)
    blk = model.blocks[0]
    pol = _fsdp_adapter.group_policy(blk)
    names = {id(p): n for n, p in blk.named_parameters()}
    # a parameter-free FSDP module has no group
    empty = torch.nn.Module()
    from torch.distributed.fsdp import fully_shard
    fully_shard(empty, mesh=mesh)
    return {"param_dtype": str(pol.param_dtype), "reduce_dtype": str(pol.reduce_dtype),
            "factor": pol.gradient_divide_factor, "force_sum": pol.force_sum_reduction,
            "params": [names[id(p)] for p in pol.params],
            "padded": [tuple(s) for s in pol.padded_shard_sizes],
            "empty": _fsdp_adapter.group_policy(empty)}


def test_group_policy_reads_fsdp2_state():
    res = run_distributed(_policy_worker, 2, backend="cpu:odc", deadline_s=120)
    for rank, r in res.items():
        assert r["param_dtype"] == "torch.bfloat16" and r["reduce_dtype"] == "torch.float32", r
        assert r["factor"] is None and r["force_sum"] is False, r
        # FSDP2's all-gather order: post-order over submodules, parameters in definition order
        assert r["params"] == ["ln1.weight", "qkv.weight", "proj.weight", "proj.bias", "ln2.weight",
                               "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"], r
        # dim-0 shards padded to ceil(rows / world): qkv (108 x 36) -> 54 rows, fc1 (100 x 36) -> 50
        assert r["padded"][1] == (54, 36) and r["padded"][5] == (50, 36), r
        assert r["empty"] is None, r


def _comms_worker(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from torch_odc_backend.config import OdcBackend

    ranks = list(range(world))
    odc_mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    gloo_mesh = DeviceMesh.from_group(dist.new_group(ranks, backend="gloo"), "cpu")
    on_odc, on_gloo = fm.build(odc_mesh)[0], fm.build(gloo_mesh)[0]
    empty = torch.nn.Module()
    fully_shard(empty, mesh=odc_mesh)
    out = {"odc": _fsdp_adapter.default_comms_on(on_odc.blocks[0], OdcBackend),
           "gloo": _fsdp_adapter.default_comms_on(on_gloo.blocks[0], OdcBackend),
           "no_params": _fsdp_adapter.default_comms_on(empty, OdcBackend),
           "cuda_only": _fsdp_adapter.default_comms_on(on_odc.blocks[0], OdcBackend, ("cuda",))}
    on_odc.blocks[0].set_allocate_memory_from_process_group_for_comm(True)
    out["not_default"] = _fsdp_adapter.default_comms_on(on_odc.blocks[0], OdcBackend)
    return out


def test_default_comms_on_tells_the_groups_backend():
    """ODC_FSDP_REGISTERED_MEMORY's test of a module: FSDP2's default communication on an odc
    group; not on another backend, not on a device not asked for (ODC_FSDP_REGISTERED_MEMORY=auto
    asks for GPUs only), not without parameters, not once the comms were replaced."""
    res = run_distributed(_comms_worker, 2, backend="cpu:odc", deadline_s=120)
    for rank, r in res.items():
        assert r == {"odc": True, "gloo": False, "no_params": False, "cuda_only": False,
                     "not_default": False}, (rank, r)


def _bindings_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model, _ = fm.build(mesh, seed=3)
    src, _ = fm.build(mesh, seed=11)
    blk = model.blocks[0]

    def state():
        with torch.no_grad():
            return [(b.param, b.registered, b.param.to_local().data_ptr(), b.all_gather_input.data_ptr())
                    for b in _fsdp_adapter.shard_bindings(blk)]

    def same(a, b):  # the same Parameters, registered, on the same storage
        return all(x[0] is y[0] and x[1] is y[1] and x[2:] == y[2:] for x, y in zip(a, b))

    first = state()
    bindings = _fsdp_adapter.shard_bindings(blk)
    out = {"names": [b.attr for b in bindings],
           "registered": all(b.registered is b.param for b in bindings),
           "shared": all(x[2] == x[3] for x in first)}
    model.load_state_dict(src.state_dict())  # in place: FSDP2's post-load hook keeps everything
    out["in_place_load"] = same(state(), first)
    model.to(torch.float64).to(torch.float32)  # same Parameters, new (re-padded) local shards
    swapped = state()
    out["swap"] = (all(x[0] is y[0] for x, y in zip(swapped, first)),
                   all(x[2] != y[2] for x, y in zip(swapped, first)),
                   all(x[2] == x[3] for x in swapped))
    blk.fc1.weight = torch.nn.Parameter(src.blocks[0].fc1.weight.detach().clone())
    attr = state()[5]
    out["attribute"] = (attr[0] is swapped[5][0], attr[1] is blk.fc1.weight)
    model.load_state_dict({k: v.detach().clone() for k, v in src.state_dict().items()}, assign=True)
    assigned = state()
    out["assign"] = (all(x[0] is not y[0] for x, y in zip(assigned, swapped)),
                     all(x[1] is x[0] for x in assigned), all(x[2] == x[3] for x in assigned))
    return out


def test_shard_bindings_follow_fsdp2():
    """What decoupled mode checks its parameters against: FSDP2's Parameter, what the module
    holds and FSDP2's all-gather storage, through an in-place load (unchanged), model.to()
    (same Parameters, new storage FSDP2 gathers from), an attribute assignment (FSDP2 keeps
    its own) and load_state_dict(assign=True) (FSDP2 takes the new Parameters)."""
    res = run_distributed(_bindings_worker, 2, backend="cpu:odc", deadline_s=120)
    for rank, r in res.items():
        assert r["names"] == ["weight", "weight", "weight", "bias", "weight", "weight", "bias",
                              "weight", "bias"], r
        assert r["registered"] and r["shared"] and r["in_place_load"], (rank, r)
        assert r["swap"] == (True, True, True), (rank, r)
        assert r["attribute"] == (True, True), (rank, r)
        assert r["assign"] == (True, True, True), (rank, r)
