"""FSDP2's reduce-scatter setters on odc must train as on gloo.

- ``FSDPModule.set_separate_reduce_scatter_group()``: FSDP2 creates a second group over the
  shard ranks (``dist.new_group(..., use_local_synchronization=True)``, so on the default
  group's backend: odc) and reduce-scatters there, while all-gathers stay on the mesh's group.
- ``FSDPModule.set_reduce_scatter_unused_params(True)``: ranks that use different parameters
  (here each rank takes another branch of every block) still reduce-scatter every parameter,
  a zero gradient for those they did not use. Without it their reduce-scatters differ in size,
  which odc reports on every rank instead of reducing garbage.

CPU, 2 ranks: one job per backend runs every configuration (the tiny transformer of
fsdp_models with a separate reduce-scatter group; a branchy model with unused parameters;
both setters at once); a third, odc only, runs the branchy model without the setter. With
2 ranks a reduction is a + b on both backends, so results are expected bitwise equal.
A setter the installed torch lacks skips its tests, naming it (torch 2.13 has both).
"""
from __future__ import annotations

import gc
import re
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule, fully_shard

import fsdp_models as fm
from dist_utils import run_distributed, run_once

WORLD = 2
ODC, REF = "cpu:odc", "gloo"
RTOL, ATOL = 1e-6, 0.0  # bitwise expected (see above); 1e-6 relative allowed
SEPARATE, UNUSED = "set_separate_reduce_scatter_group", "set_reduce_scatter_unused_params"


def _needs(*setters):
    missing = [s for s in setters if not hasattr(FSDPModule, s)]
    return pytest.mark.skipif(bool(missing), reason=f"torch {torch.__version__} has no "
                              + ", ".join(f"FSDPModule.{s}" for s in missing))


# -- a model whose ranks use different parameters --------------------------------------------

DIM, STEPS = 20, 3


class Branchy(nn.Module):
    """Blocks with two branches of different sizes (``b`` has no bias); rank r takes branch
    ``a`` at step s iff (r + s) is even, so at every step each rank leaves one branch unused."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(DIM, DIM)
            self.a = nn.Linear(DIM, DIM)
            self.b = nn.Linear(DIM, DIM, bias=False)

        def forward(self, x, use_a: bool):
            h = F.gelu(self.inp(x))
            return x + (self.a(h) if use_a else self.b(h))

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(self.Block() for _ in range(2))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x, use_a: bool):
        for blk in self.blocks:
            x = blk(x, use_a)
        return self.head(x)


def _branchy_train(mesh, *, unused: bool, separate: bool, steps=STEPS):
    torch.manual_seed(3)
    model = Branchy()
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if unused:
        model.set_reduce_scatter_unused_params(True)
    if separate:
        model.set_separate_reduce_scatter_group()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.01)
    rank, losses = dist.get_rank(), []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(6, DIM, generator=g), torch.randn(6, DIM, generator=g)
        loss = F.mse_loss(model(x, use_a=(rank + step) % 2 == 0), y)
        loss.backward()
        losses.append(loss.item())
        if step == steps - 1:
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    out = {"losses": losses, "grads": grads, "params": fm.full_params(model)}
    del model, opt
    return out


def _tiny_lm_separate(mesh):
    """fsdp_models' transformer and loop, with reduce-scatters on FSDP2's separate group;
    gradient accumulation and clipping included."""
    model, opt = fm.build(mesh)
    model.set_separate_reduce_scatter_group()
    res = fm.run_steps(model, opt, grad_accum=2, clip_norm=0.05)
    out = {**res, "params": fm.full_params(model)}
    del model, opt
    return out


def _worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    configs = {}
    if hasattr(FSDPModule, SEPARATE):
        configs["tiny_lm_separate_rs"] = lambda: _tiny_lm_separate(mesh)
    if hasattr(FSDPModule, UNUSED):
        configs["branchy_unused"] = lambda: _branchy_train(mesh, unused=True, separate=False)
    if hasattr(FSDPModule, SEPARATE) and hasattr(FSDPModule, UNUSED):
        configs["branchy_unused_separate_rs"] = lambda: _branchy_train(mesh, unused=True, separate=True)
    out = {}
    for name, run in configs.items():
        with fm.CallSpy() as spy:
            try:
                out[name] = run()
            except Exception:  # report per configuration; the other ones still run
                out[name] = {"error": traceback.format_exc()}
            gc.collect()
        out[name]["calls"] = dict(spy.calls)
        out[name]["groups"] = fm.group_report(spy)
    return fm.to_wire(out)


def _mismatch_worker(rank, world):
    """The branchy model without set_reduce_scatter_unused_params: what the first backward
    raises on this rank."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    try:
        _branchy_train(mesh, unused=False, separate=False, steps=1)
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    return None


@pytest.fixture(scope="module")
def run():
    def launch(backend):
        if backend == "mismatch":
            return run_distributed(_mismatch_worker, WORLD, timeout_s=30, deadline_s=120)
        return run_distributed(_worker, WORLD, backend=backend, deadline_s=180)

    return run_once(launch)


def _result(run, backend, name, rank):
    res = run(backend)[rank][name]
    assert "error" not in res, f"{backend} rank {rank} {name}:\n{res['error']}"
    return res


def _assert_same(got, ref, what):
    def check(a, b, label):
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what} {label}: {m}")

    check(got["losses"], ref["losses"], "losses")
    if "norms" in ref:
        check(got["norms"], ref["norms"], "grad norms")
    for kind in ("grads", "params"):
        assert got[kind].keys() == ref[kind].keys()
        for name in ref[kind]:
            check(got[kind][name], ref[kind][name], f"{kind[:-1]} {name}")


def _groups_by_op(calls):
    by_op = {}
    for (g_name, _, op, *_), n in calls.items():
        by_op.setdefault(op, set()).add(g_name)
    return by_op


@_needs(SEPARATE)
@pytest.mark.parametrize("name", ["tiny_lm_separate_rs"] + (
    ["branchy_unused_separate_rs"] if hasattr(FSDPModule, UNUSED) else []))
def test_separate_reduce_scatter_group_trains_as_gloo(run, name):
    for rank in range(WORLD):
        got, ref = _result(run, ODC, name, rank), _result(run, REF, name, rank)
        _assert_same(got, ref, f"{name} rank {rank} odc vs gloo")
        # FSDP2 reduce-scattered on a group of its own, all-gathered on the mesh's, and both
        # are odc groups whose one-sided paths served every call
        by_op = _groups_by_op(got["calls"])
        assert by_op.get("reduce_scatter") and by_op.get("all_gather"), by_op
        assert not by_op["reduce_scatter"] & by_op["all_gather"], by_op
        fm.assert_fsdp_used_odc(got["calls"], got["groups"], what=f"{name} rank {rank}")
    losses = [_result(run, ODC, name, r)["losses"] for r in range(WORLD)]
    assert len({tuple(l) for l in losses}) == WORLD  # the ranks saw different data


@_needs(UNUSED)
@pytest.mark.parametrize("name", ["branchy_unused"])
def test_reduce_scatter_unused_params_trains_as_gloo(run, name):
    for rank in range(WORLD):
        got, ref = _result(run, ODC, name, rank), _result(run, REF, name, rank)
        _assert_same(got, ref, f"{name} rank {rank} odc vs gloo")
        fm.assert_fsdp_used_odc(got["calls"], got["groups"], what=f"{name} rank {rank}")
        # every branch got a gradient in the last step: half of what the rank using it saw
        for blk in range(2):
            for branch in ("a", "b"):
                assert torch.as_tensor(got["grads"][f"blocks.{blk}.{branch}.weight"]).abs().sum() > 0


@_needs(UNUSED)
def test_without_unused_params_setter_odc_names_the_mismatch(run):
    """Ranks that used different branches reduce-scatter different sizes: odc raises on every
    rank, naming both sides (the setter above is the fix)."""
    for rank, msg in run("mismatch").items():
        assert msg is not None, f"rank {rank}: the mismatched reduce-scatter went through"
        sizes = re.findall(r"(\d+) bytes per rank", msg)
        assert len(set(sizes)) >= 2, f"rank {rank}: {msg}"
