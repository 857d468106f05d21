"""FSDP1 and DTensor callers trained on odc and on a reference backend, in one process.

Used by test_callers.py on both devices (CPU: "cpu:odc" against gloo; CUDA:
"cpu:gloo,cuda:odc" against NCCL). `run_configs` runs every configuration twice in each
worker: once on meshes whose groups use the default backend (odc) and once on meshes whose
groups are created with the reference backend (`init_device_mesh(backend_override=...)`).
The reference meshes get other `mesh_dim_names`: two meshes of one shape otherwise compare
equal and DTensor / FSDP could mix them up (docs/design.md, "Known limits").

Both runs start from the same seeded weights and see the same batches (fsdp_models.batch),
so they may differ only where the collectives differ.
"""
from __future__ import annotations

import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fsdp_models as fm
from dist_utils import NVSHMEM_SUITE

# name -> configuration, per world size; "kind" picks the trainer.
CONFIGS = {
    2: {
        "fsdp1_full_shard": dict(kind="fsdp1", mesh=(2,), strategy="FULL_SHARD"),
        "fsdp1_shard_grad_op": dict(kind="fsdp1", mesh=(2,), strategy="SHARD_GRAD_OP"),
        "fsdp1_full_shard_bf16": dict(kind="fsdp1", mesh=(2,), strategy="FULL_SHARD", bf16=True),
        # sequence parallel + loss_parallel: all-gathers and reduce-scatters of activations
        "tp_sp_loss_parallel": dict(kind="tp", mesh=(2,), sequence_parallel=True),
        # plain Colwise/Rowwise MLP: only all-reduces, small here: odc's own on GPUs, gloo's on CPU
        "tp_mlp": dict(kind="tp", mesh=(2,), sequence_parallel=False),
        "redistribute": dict(kind="redistribute", mesh=(2,)),
    },
    4: {
        "fsdp1_hybrid_2x2": dict(kind="fsdp1", mesh=(2, 2), strategy="HYBRID_SHARD"),
        "fsdp2_tp_2x2": dict(kind="fsdp2_tp", mesh=(2, 2)),
        "redistribute_2x2": dict(kind="redistribute", mesh=(2, 2)),
    },
}
DIM_NAMES = {"fsdp1": ("replicate", "shard"), "fsdp2_tp": ("dp", "tp"), "tp": ("tp",),
             "redistribute": ("a", "b")}
STEPS = 3
FSDP1_UNITS = fm.LAYERS + 1  # one FSDP1 unit per block, plus the root


def expected_odc_ops(cfg: dict, device_type: str) -> dict[str, int]:
    """Counter -> the least its increase over the odc run (the odc meshes' groups) may be."""
    kind = cfg["kind"]
    if kind == "fsdp1":
        # One reduce-scatter per unit and step. The parameter all-gathers go to odc on CUDA
        # only: for CPU tensors FSDP1 all-gathers into a *list* of chunks ("HACK this should
        # be handled by C10D", torch/distributed/fsdp/_flat_param.py, _all_gather_flat_param),
        # and odc delegates the list form to gloo.
        need = {"reduce_scatter_ops": FSDP1_UNITS * STEPS}
        return need | ({"all_gather_ops": FSDP1_UNITS * STEPS} if device_type == "cuda" else
                       {"delegated_ops": FSDP1_UNITS * STEPS})
    if kind == "tp" and not cfg["sequence_parallel"]:
        # plain TP communicates by all-reduce only: gloo's for CPU tensors; on GPUs of their
        # own odc serves these small ones itself (ODC_SELF_SERVE=auto), NCCL with peers over
        # NVSHMEM
        own = device_type == "cuda" and not NVSHMEM_SUITE
        return {"own_all_reduce_ops" if own else "delegated_ops": STEPS}
    if kind == "redistribute":
        return {"all_gather_ops": len(redistribute_cases())}  # at least one per case
    return {"all_gather_ops": STEPS, "reduce_scatter_ops": STEPS}


def _optimizer(model):
    # as fsdp_models.build: eps well above the gradients' fp32 noise floor. foreach=False: plain
    # TP leaves some parameters plain tensors, and the foreach kernels (CUDA's default) refuse
    # a mix of tensors and DTensors; on CPU the per-parameter loop is the default anyway.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.01, foreach=False)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _wire(tensors: dict) -> dict:
    # clone: FSDP1's unsharded parameters and its gradient views share storage that FSDP1
    # frees (resizes to 0) or reuses later
    return {n: _full(t).detach().float().cpu().clone() for n, t in tensors.items()}


# ---------------------------------------------------------------- FSDP1

def train_fsdp1(mesh, device, *, strategy, bf16=False, seed=0):
    """fsdp_models.new_model() under FullyShardedDataParallel(use_orig_params=True), one FSDP unit
    per block plus the root, AdamW. Returns per-step losses and global grad norms, the last
    step's local gradient shards (same sharding in both runs), and the full parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(seed)
    model = FSDP(
        fm.new_model(), device_mesh=mesh, sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({fm.Block}), use_orig_params=True,
        # FSDP1 needs an explicit device without an accelerator ("FSDP needs a non-CPU
        # accelerator device" otherwise); torch.device("cpu") works.
        device_id=device,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None,
    )
    opt = _optimizer(model)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = fm.batch(seed, dist.get_rank(), step, device=device)  # every rank is data-parallel
        loss = F.cross_entropy(model(x).float(), y.reshape(-1))
        loss.backward()
        losses.append(loss.item())
        if step == STEPS - 1:
            grads = _wire({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        # FSDP1's own clipping (all-reduce of the squared shard norms); the max is far above
        # the norm, so the gradients are multiplied by exactly 1.0
        norms.append(model.clip_grad_norm_(1e9).item())
        opt.step()
        opt.zero_grad()
    with FSDP.summon_full_params(model):
        params = _wire(dict(model.named_parameters()))
    return {"losses": losses, "norms": norms, "grads": grads, "params": params}


# ---------------------------------------------------------------- tensor parallelism

class TPNet(nn.Module):
    """Embedding, a residual MLP with norms, and an output head (odd sizes from fsdp_models:
    the head's vocab of 97 shards unevenly)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(fm.VOCAB, fm.DIM)
        self.norm1 = nn.LayerNorm(fm.DIM)
        self.fc1 = nn.Linear(fm.DIM, fm.MLP_DIM)
        self.fc2 = nn.Linear(fm.MLP_DIM, fm.DIM)
        self.norm2 = nn.RMSNorm(fm.DIM)
        self.head = nn.Linear(fm.DIM, fm.VOCAB)

    def forward(self, tokens):
        x = self.emb(tokens)
        x = x + self.fc2(F.gelu(self.fc1(self.norm1(x))))
        return self.head(self.norm2(x))


def _tp_plan(sequence_parallel: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if not sequence_parallel:
        return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    # Megatron-style sequence parallelism (as torchtitan): activations between the TP regions
    # are sharded on the sequence dim, entering a region all-gathers them and leaving it
    # reduce-scatters; the head's output stays vocab-sharded for loss_parallel.
    return {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm1": SequenceParallel(),
        "fc1": ColwiseParallel(input_layouts=Shard(1)),
        "fc2": RowwiseParallel(output_layouts=Shard(1)),
        "norm2": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    }


def train_tp(mesh, device, *, sequence_parallel=True, fsdp=False, seed=0):
    """TPNet under parallelize_module on the mesh's last dim (and, with fsdp, fully_shard on
    its first: FSDP2 + TP). Returns per-step losses, the last step's full gradients and the
    full parameters."""
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    names = mesh.mesh_dim_names
    tp_mesh = mesh[names[-1]]
    torch.manual_seed(seed)
    model = parallelize_module(TPNet().to(device), tp_mesh, _tp_plan(sequence_parallel))
    dp_rank = 0
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        dp_rank = mesh[names[0]].get_local_rank()
        fully_shard(model, mesh=mesh[names[0]])
    opt = _optimizer(model)
    losses = []
    for step in range(STEPS):
        x, y = fm.batch(seed, dp_rank, step, device=device)  # the same batch across a TP group
        with loss_parallel() if sequence_parallel else torch.enable_grad():
            loss = F.cross_entropy(model(x).flatten(0, 1), y.reshape(-1))
            loss.backward()
        losses.append(_full(loss).item())
        if step == STEPS - 1:
            grads = _wire({n: p.grad for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "params": _wire(dict(model.named_parameters()))}


# ---------------------------------------------------------------- plain DTensor redistribute

def redistribute_cases(seed=0) -> dict[str, tuple[torch.Tensor, int]]:
    """name -> (full tensor, the dim that the mesh's first dim shards; a second mesh dim
    shards the other dim, or dim 0 again for 1-D tensors)."""
    g = torch.Generator().manual_seed(seed)
    f32 = torch.randn(37, 5, generator=g)
    f32.view(-1)[:4] = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf")])
    return {
        "f32_dim0": (f32, 0),
        "f32_even_dim0": (torch.randn(8, 6, generator=g), 0),  # no padding at world 2 or 2x2
        "bf16_dim1": (torch.randn(7, 9, generator=g).bfloat16(), 1),
        "f16_dim0": (torch.randn(3, 11, generator=g).half(), 0),
        "i64_dim0": (torch.randint(-2**62, 2**62, (5,), generator=g), 0),
    }


def redistribute(mesh, device, seed=0):
    """distribute_tensor (scatter from rank 0 of the mesh) and redistribute to Replicate
    (all-gathers) for even and uneven sizes, several dtypes and special values. Returns,
    per case, the bytes of the source tensor and of the gathered one."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    cases = redistribute_cases(seed)
    out = {}
    for name, (src, dim) in cases.items():
        # only the mesh's first rank holds the data: the scatter must take it from there
        first = list(mesh.get_coordinate()) == [0] * mesh.ndim
        inp = src.to(device) if first else torch.zeros_like(src, device=device)
        placements = [Shard(dim)] + [Shard(0 if dim else 1)] * (mesh.ndim - 1)
        if src.ndim == 1:
            placements = [Shard(0)] * mesh.ndim
        d = distribute_tensor(inp, mesh, placements)
        full = d.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
        out[name] = {"src": _bytes(src), "gathered": _bytes(full.cpu())}
    return out


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


# ---------------------------------------------------------------- both backends, one worker

def _odc_counters(groups, device) -> dict:
    import torch_odc_backend as odc

    total = {}
    for pg in groups:
        for k, v in odc.backend_stats(pg, device.type).items():
            total[k] = total.get(k, 0) + v
    return total


def _groups(mesh):
    return [mesh.get_group(d) for d in range(mesh.ndim)]


def run_configs(rank, world, configs, device, ref_backend):
    """Run every configuration on odc meshes and on `ref_backend` meshes. Per configuration:
    {"odc": result, "ref": result, "odc_delta": odc counters moved by the odc run (over the
    odc meshes' groups), "odc_delta_in_ref": the same counters moved by the reference run,
    "backends": {"odc": [...], "ref": [...]} (per mesh dim)} or {"error": traceback}."""
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    for name, cfg in configs.items():
        cfg = dict(cfg)
        kind, shape = cfg.pop("kind"), cfg.pop("mesh")
        dims = DIM_NAMES[kind][-len(shape):]
        try:
            res = {"backends": {}}
            meshes = {
                "odc": init_device_mesh(device.type, shape, mesh_dim_names=dims),
                "ref": init_device_mesh(device.type, shape, mesh_dim_names=tuple(f"ref_{d}" for d in dims),
                                        backend_override={f"ref_{d}": ref_backend for d in dims}),
            }
            odc_groups = _groups(meshes["odc"])
            for tag, mesh in meshes.items():
                res["backends"][tag] = [pg._get_backend(device).name() for pg in _groups(mesh)]
                before = _odc_counters(odc_groups, device)
                if kind == "fsdp1":
                    res[tag] = train_fsdp1(mesh, device, **cfg)
                elif kind in ("tp", "fsdp2_tp"):
                    res[tag] = train_tp(mesh, device, fsdp=kind == "fsdp2_tp", **cfg)
                else:
                    res[tag] = redistribute(mesh, device, **cfg)
                after = _odc_counters(odc_groups, device)
                delta = {k: after[k] - before.get(k, 0) for k in after}
                res["odc_delta" if tag == "odc" else "odc_delta_in_ref"] = delta
            out[name] = res
        except Exception:  # report per configuration; the other ones still run
            out[name] = {"error": traceback.format_exc()}
    if device.type == "cuda":
        torch.cuda.synchronize()
    return fm.to_wire(out)


# ---------------------------------------------------------------- checks (in the test process)

def config_result(results: dict, rank: int, name: str) -> dict:
    res = results[rank][name]
    assert "error" not in res, f"rank {rank} {name}:\n{res['error']}"
    return res


def assert_close(got: dict, ref: dict, *, rtol, atol, what=""):
    """Every entry of two trainer results: losses (and norms), gradients, parameters."""
    assert got.keys() == ref.keys(), (what, got.keys(), ref.keys())
    assert len(ref["losses"]) == STEPS
    for key in ref:
        if isinstance(ref[key], dict):
            assert got[key].keys() == ref[key].keys() and ref[key], (what, key)
            pairs = [(f"{key} {n}", got[key][n], ref[key][n]) for n in ref[key]]
        else:
            pairs = [(key, got[key], ref[key])]
        for label, a, b in pairs:
            torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), rtol=rtol, atol=atol,
                                       msg=lambda m, label=label: f"{what} {label}: {m}")


def assert_used_backends(res: dict, ref_backend: str, need: dict[str, int], what=""):
    """The odc run's groups are odc and moved at least `need` (expected_odc_ops); the
    reference run's groups are `ref_backend` and moved none of odc's counters."""
    assert set(res["backends"]["odc"]) == {"odc"}, (what, res["backends"])
    assert set(res["backends"]["ref"]) == {ref_backend}, (what, res["backends"])
    for key, least in need.items():
        assert res["odc_delta"].get(key, 0) >= least, (what, key, least, res["odc_delta"])
    assert not any(res["odc_delta_in_ref"].values()), (what, res["odc_delta_in_ref"])
