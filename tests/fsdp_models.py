"""The tests' tiny transformer (examples/tiny_lm.py at odd sizes) and FSDP2 training loop.

Sizes are deliberately odd (hidden 36, vocab 97, MLP 100) so that dim-0 shards
need padding for world sizes 2 and 4. Everything is deterministic: the model is
initialised from a seed on CPU (identically on every rank) before sharding, and
each rank's batch depends only on (seed, data-parallel rank, step, microbatch).
"""
from __future__ import annotations

import collections
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from tiny_lm import Block, TinyLM  # noqa: E402,F401  (examples/tiny_lm.py; Block: the FSDP unit)

VOCAB, DIM, HEADS, MLP_DIM, LAYERS = 97, 36, 3, 100, 3
BATCH, SEQ = 4, 16


def new_model() -> TinyLM:
    """The shared TinyLM (examples/tiny_lm.py) at the tests' sizes: no position embedding,
    norm types alternating over the blocks (RMSNorm first, so both RMSNorm's and LayerNorm's
    parameters are sharded), no bias in qkv, a bias in the head (a 1-D parameter of odd
    length), PyTorch's default initialisation, logits as (batch * seq, vocab)."""
    return TinyLM(VOCAB, DIM, HEADS, LAYERS, mlp=MLP_DIM, norms=(nn.RMSNorm, nn.LayerNorm),
                  qkv_bias=False, head_bias=True, init_std=None, flat_logits=True)


def batch(seed: int, dp_rank: int, step: int, micro: int = 0, device="cpu"):
    g = torch.Generator().manual_seed(((seed * 1009 + dp_rank) * 1009 + step) * 1009 + micro)
    tok = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tok[:, :-1].to(device), tok[:, 1:].to(device)


def build(mesh, *, seed=0, reshard_after_forward=True, mp_policy=None, device="cpu",
          offload_policy=None, registered=False):
    """Seeded new_model(), fully_shard per block and on the root, plus AdamW. With an offload
    policy the parameters stay on the host (FSDP2 wants them there)."""
    torch.manual_seed(seed)
    model = new_model().to("cpu" if offload_policy is not None else device)
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    if offload_policy is not None:
        kw["offload_policy"] = offload_policy
    for blk in model.blocks:
        fully_shard(blk, **kw)
    fully_shard(model, **kw)
    if registered:  # FSDP2's buffers from odc's registered memory: zero-copy collectives
        import torch_odc_backend

        torch_odc_backend.use_registered_memory(model)
    # eps well above the fp32 noise floor of the gradients: Adam's first update is
    # ~lr*sign(g), so with a tiny eps a gradient that cancels to ~0 could flip sign
    # under a different (equally valid) summation order and move a weight by 2*lr.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.01)
    return model, opt


def run_steps(model, opt, *, seed=0, start=0, steps=3, grad_accum=1, clip_norm=None, device="cpu"):
    """Train. Returns per-step local losses, per-step global grad norms (pre-clip), and the
    last step's reduced full gradients: AdamW is nearly invariant to a gradient's scale,
    so a reduction bug such as SUM-instead-of-AVG shows in these, not in the weights."""
    dp_rank = dist.get_rank()
    losses, norms = [], []
    for step in range(start, start + steps):
        total = 0.0
        for m in range(grad_accum):
            # Gradient accumulation without communication on all but the last microbatch.
            model.set_requires_gradient_sync(m == grad_accum - 1)
            x, y = batch(seed, dp_rank, step, m, device)
            loss = F.cross_entropy(model(x).float(), y.reshape(-1))
            (loss / grad_accum).backward()
            total += loss.item()
        losses.append(total / grad_accum)
        params = list(model.parameters())
        if step == start + steps - 1:
            grads = {n: p.grad.full_tensor().float().cpu() for n, p in model.named_parameters()}
        if clip_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, clip_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "grads": grads}


def reference_train(world: int, *, seed=0, steps=3, grad_accum=1, clip_norm=None, bf16=False,
                    device="cpu") -> list[dict]:
    """What `train` computes on each of `world` data-parallel ranks, in one process without
    any sharding: each rank's losses on its own batches, the gradient averaged over ranks
    (FSDP2's default reduction), clipping on the whole gradient, AdamW. With bf16, each
    forward and backward runs on a bf16 copy of the fp32 weights and the gradients are
    reduced in fp32, as MixedPrecisionPolicy(bfloat16, float32) does. Returns one `train`
    result per rank (only the losses differ between them). CPU kernels run on one thread,
    as the test workers do (a matmul's summation order, so its rounding, depends on it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_train(world, seed, steps, grad_accum, clip_norm, bf16, device)
    finally:
        torch.set_num_threads(threads)


def _reference_train(world, seed, steps, grad_accum, clip_norm, bf16, device):
    torch.manual_seed(seed)
    model = new_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.01)
    compute = new_model().to(device=device, dtype=torch.bfloat16) if bf16 else model
    losses, norms = [[] for _ in range(world)], []
    for step in range(steps):
        if bf16:
            with torch.no_grad():
                for c, p in zip(compute.parameters(), model.parameters()):
                    c.copy_(p)
        for r in range(world):
            loss_r = 0.0
            for m in range(grad_accum):
                x, y = batch(seed, r, step, m, device)
                loss = F.cross_entropy(compute(x).float(), y.reshape(-1))
                (loss / grad_accum).backward()
                loss_r += loss.item()
            losses[r].append(loss_r / grad_accum)
            if bf16:  # each rank's bf16 gradient, reduced in fp32
                for c, p in zip(compute.parameters(), model.parameters()):
                    p.grad = c.grad.float() if p.grad is None else p.grad + c.grad.float()
                    c.grad = None
        with torch.no_grad():
            for p in model.parameters():
                p.grad.div_(world)
        params = list(model.parameters())
        if step == steps - 1:
            grads = {n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters()}
        if clip_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, clip_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norms.append(float(norm))
        opt.step()
        opt.zero_grad()
    final = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    return [{"losses": losses[r], "norms": norms, "grads": grads, "params": final} for r in range(world)]


def full_params(model) -> dict[str, torch.Tensor]:
    """Unsharded parameters as CPU float32 tensors (collective: all ranks must call)."""
    return {n: p.full_tensor().detach().float().cpu() for n, p in model.named_parameters()}


def train(mesh, *, seed=0, steps=3, reshard_after_forward=True, mp_policy=None,
          grad_accum=1, clip_norm=None, device="cpu", registered=False):
    model, opt = build(mesh, seed=seed, reshard_after_forward=reshard_after_forward,
                       mp_policy=mp_policy, device=device, registered=registered)
    res = run_steps(model, opt, seed=seed, steps=steps, grad_accum=grad_accum,
                    clip_norm=clip_norm, device=device)
    return {**res, "params": full_params(model)}


# run_distributed cannot return torch tensors (torch.multiprocessing would share them
# through file descriptors of a worker that has already exited), so results travel
# as numpy arrays.
def to_wire(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: to_wire(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_wire(v) for v in obj)
    return obj


def assert_runs_close(got, ref, *, rtol, atol, what=""):
    """Compare two `train` results: losses, grad norms, last gradients, final params."""
    def check(a, b, label):
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what} {label}: {m}")

    assert len(got["losses"]) == len(ref["losses"]) > 0
    check(got["losses"], ref["losses"], "losses")
    check(got["norms"], ref["norms"], "grad norms")
    for kind in ("grads", "params"):
        assert got[kind].keys() == ref[kind].keys()
        for name in ref[kind]:
            check(got[kind][name], ref[kind][name], f"{kind[:-1]} {name}")


# bf16 params / fp32 reduction: a few-ulp fp32 difference in a master weight can flip its
# bf16 rounding (2^-8 relative) for the next forward, so losses, grad norms and (per tensor,
# in norm) gradients of two correct runs may drift by ~1e-3 relative; a wrong shard, offset
# or scale moves them by far more than 1e-2. Final weights: AdamW moves each weight by ~lr
# per step, so their difference is compared with the size of the update itself.
BF16_RTOL, BF16_UPDATE_RTOL = 1e-2, 5e-2


def assert_bf16_runs_close(got, ref, *, what=""):
    """Compare two bf16 (MixedPrecisionPolicy(bfloat16, float32)) `train` results."""
    def rel_close(a, b, base, tol, label):
        for name, r in b.items():
            diff = (torch.as_tensor(a[name]) - torch.as_tensor(r)).norm()
            scale = torch.as_tensor(base[name]).norm()
            assert scale > 0 and diff <= tol * scale, f"{what} {label} {name}: |diff|={diff:.3g} vs {tol}*{scale:.3g}"

    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.as_tensor(got[key]), torch.as_tensor(ref[key]), rtol=BF16_RTOL,
                                   atol=0, msg=lambda m: f"{what} {key}: {m}")
    rel_close(got["grads"], ref["grads"], ref["grads"], BF16_RTOL, "grad")
    init = init_params()
    updates = {n: torch.as_tensor(p) - init[n] for n, p in ref["params"].items()}
    rel_close(got["params"], ref["params"], updates, BF16_UPDATE_RTOL, "param")


class CallSpy:
    """Counts eager c10d calls (what FSDP2 issues) per (group, group size, op, dtype, reduce
    op, async_op). Ops are named "all_gather" / "reduce_scatter" / "all_reduce" whichever
    ProcessGroup method carries them (torch 2.13: all_gather_single / reduce_scatter_single;
    older: _allgather_base / _reduce_scatter_base)."""

    OPS = {"all_gather_single": "all_gather", "_allgather_base": "all_gather",
           "reduce_scatter_single": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
           "allreduce": "all_reduce"}

    def __enter__(self):
        self.calls, self._orig = collections.Counter(), {}
        for method, op in self.OPS.items():
            if not hasattr(dist.ProcessGroup, method):
                continue
            orig = self._orig[method] = getattr(dist.ProcessGroup, method)

            def wrapped(pg, *args, _op=op, _orig=orig):
                opts = args[-1]
                t = args[0][0] if isinstance(args[0], list) else args[0]
                red = getattr(opts, "reduceOp", None)
                red = red if red is None else str(red.op).rsplit(".", 1)[-1]
                self.calls[(pg.group_name, pg.size(), _op, str(t.dtype), red,
                            getattr(opts, "asyncOp", None))] += 1
                return _orig(pg, *args)

            setattr(dist.ProcessGroup, method, wrapped)
        return self

    def __exit__(self, *exc):
        for method, orig in self._orig.items():
            setattr(dist.ProcessGroup, method, orig)


def group_report(spy: CallSpy, device: str = "cpu") -> dict:
    """Backend name and counters (if exposed) of every group the spied calls used."""
    out = {}
    for g_name in {k[0] for k in spy.calls}:
        pg = dist.distributed_c10d._resolve_process_group(g_name)
        backend = pg._get_backend(torch.device(device))
        stats = dict(backend.stats()) if hasattr(backend, "stats") else None
        out[g_name] = {"backend": backend.name(), "stats": stats}
    return out


def assert_fsdp_used_odc(calls: dict, groups: dict, what=""):
    """Every group FSDP all-gathered / reduce-scattered in is served by odc, and (if the
    backend exposes counters) each of those calls took its one-sided path."""
    counts = collections.Counter()
    for (g_name, _, op, *_), n in calls.items():
        counts[g_name, op] += n
    fsdp_groups = {g for g, op in counts if op in ("all_gather", "reduce_scatter")}
    assert fsdp_groups, f"{what}: FSDP issued no all-gather / reduce-scatter"
    for g_name in fsdp_groups:
        info = groups[g_name]
        assert info["backend"] == "odc", (what, g_name, info)
        if info["stats"] is None:  # backend without counters: name check only
            continue
        # >=: DTensor.full_tensor also all-gathers through the backend.
        for op, key in (("all_gather", "all_gather_ops"), ("reduce_scatter", "reduce_scatter_ops")):
            assert info["stats"].get(key, 0) >= counts[g_name, op], (what, g_name, op, counts[g_name, op], info)


def init_params(seed=0) -> dict[str, torch.Tensor]:
    """The parameters `build` starts from (same names as the FSDP-wrapped model's)."""
    torch.manual_seed(seed)
    return {n: p.detach().clone() for n, p in new_model().named_parameters()}
