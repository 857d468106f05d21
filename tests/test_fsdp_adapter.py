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
