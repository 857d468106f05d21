"""odc.release / odc.restore: decoupled mode gives its arena back between minibatches (as a
trainer that offloads the model to the host needs), with the group's staging rings where no
arena is left on it, and comes back with the parameters in new storage, training exactly as
without; misuse is refused with a clear error."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fsdp_models as fm
from dist_utils import GPU_ENV, cuda_case, run_distributed
from test_decoupled import STEPS, _assignments, _microbatch_loss


def _offload_and_load(model, device: str) -> None:
    """What a trainer's offload and load do to the parameters: the same values, new storage."""
    model.to("cpu")
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        assert next(model.parameters()).device.type == "cpu"
    model.to(device)
    if device == "cpu":  # on the host .to("cpu") keeps the storage: move it by hand
        model.to(torch.float64).to(torch.float32)


def _shm_mappings() -> int:
    """This process's mappings of host shared memory (the CPU transport's windows and arenas)."""
    with open("/proc/self/maps") as f:
        return sum("/dev/shm/" in line for line in f)


_HOST_GROUP = None  # a gloo group: its barriers take nothing on the GPU


def _device_free(device: str) -> int:
    """Free device memory once every rank got here (where ranks share a GPU, none of them then
    takes or gives back memory between two measurements of a release)."""
    if device == "cpu":
        return 0
    torch.cuda.synchronize()
    dist.barrier(group=_HOST_GROUP)
    free = torch.cuda.mem_get_info()[0]
    dist.barrier(group=_HOST_GROUP)
    return free


def _release_cycle(model, device: str, out: dict, forward: bool = True) -> None:
    """odc.release, the trainer's offload and load, odc.restore; then (forward) a forward-only
    pass, as a trainer's log-prob computation, and a second release after it."""
    import torch_odc_backend as odc

    arena = odc.decoupled._state_of(model).arena
    before = _shm_mappings()
    free = _device_free(device)
    odc.release(model)
    if device == "cpu":  # the arena's segments (this rank's and each peer's) are unmapped
        out["unmapped"].append(before - _shm_mappings())
    else:  # given back to the device (ranks sharing this GPU give theirs back too)
        out["freed"].append(_device_free(device) - free)
    out["arenas"].append(arena)
    _offload_and_load(model, device)
    odc.restore(model)
    if forward:
        with torch.no_grad():
            _microbatch_loss(model, 0, 0, device)  # gets only: release may follow
        odc.release(model)
        odc.restore(model)


def _train(mesh, device: str, *, decoupled: bool, release: bool, accumulate: str = "owner"):
    import torch_odc_backend as odc

    model, opt = fm.build(mesh, seed=3, device=device)
    out = {"unmapped": [], "arenas": [], "freed": []}
    if decoupled:
        odc.decouple(model, opt, accumulate=accumulate)
        if release:  # before the first minibatch: nothing published yet
            _release_cycle(model, device, out)
    dp, rank = dist.get_world_size(), dist.get_rank()
    grads = []
    for step in range(STEPS):
        for mb in _assignments(dp, step, uneven=decoupled)[rank]:
            _microbatch_loss(model, mb, step, device).backward()
        if decoupled:
            odc.sync(model)
            if release and step == 1:  # after the sync, before the step (no forward there:
                _release_cycle(model, device, out, forward=False)  # it would open a minibatch)
        grads.append({n: p.grad.full_tensor().float().cpu() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        if release:  # after the step (which published the next minibatch's shards)
            _release_cycle(model, device, out)
    result = {"grads": grads, "params": fm.full_params(model), "unmapped": out["unmapped"],
              "freed": out["freed"]}
    result["released_arenas_refused"] = []  # a released arena is gone: any call on it raises
    for arena in out["arenas"]:
        try:
            arena.size()
            result["released_arenas_refused"].append(False)
        except ValueError as e:
            result["released_arenas_refused"].append("released" in str(e))
    return result


def _misuse(mesh, device: str) -> dict:
    import torch_odc_backend as odc

    model, opt = fm.build(mesh, seed=4, device=device)
    odc.decouple(model, opt)
    out = {}
    _microbatch_loss(model, 0, 0, device).backward()
    try:  # inside a minibatch: peers may still read this rank's shards
        odc.release(model)
    except RuntimeError as e:
        out["during"] = str(e)
    odc.sync(model)
    opt.step()
    opt.zero_grad()
    odc.release(model)
    odc.release(model)  # again: nothing more to give back
    try:
        _microbatch_loss(model, 1, 1, device).backward()
    except RuntimeError as e:
        out["forward"] = str(e)
    odc.restore(model)
    _microbatch_loss(model, 1, 1, device).backward()  # and the group goes on
    odc.sync(model)
    out["after"] = True
    return out


def _worker(rank, world, device):
    from torch.distributed.device_mesh import init_device_mesh

    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    mesh = init_device_mesh(device, (world,))
    global _HOST_GROUP
    _HOST_GROUP = dist.new_group(backend="gloo")
    out = {"exact": _train(mesh, device, decoupled=False, release=False),
           "released": _train(mesh, device, decoupled=True, release=True),
           "released_local": _train(mesh, device, decoupled=True, release=True, accumulate="local"),
           "misuse": _misuse(mesh, device)}
    return fm.to_wire(out)


@pytest.mark.parametrize("device", ["cpu", cuda_case("cuda", gpus=2)])
def test_release_and_restore_between_minibatches(device):
    backend = "cpu:odc" if device == "cpu" else "cpu:gloo,cuda:odc"
    env = dict(GPU_ENV) if device == "cuda" else {}
    res = run_distributed(_worker, 2, device, backend=backend, env=env, deadline_s=300)
    for rank, r in res.items():
        for run in ("released", "released_local"):
            for step, (want, got) in enumerate(zip(r["exact"]["grads"], r[run]["grads"])):
                for name in want:
                    torch.testing.assert_close(torch.as_tensor(got[name]), torch.as_tensor(want[name]), rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"rank {rank} {run} step {step} {name}: {m}")
            for name, p in r["exact"]["params"].items():
                torch.testing.assert_close(torch.as_tensor(r[run]["params"][name]), torch.as_tensor(p),
                                           rtol=1e-5, atol=1e-6)
            assert r[run]["released_arenas_refused"] == [True] * (STEPS + 2), (rank, run)
            if device == "cpu":  # every rank's segment of the arena
                assert r[run]["unmapped"] == [2] * (STEPS + 2), (rank, run, r[run]["unmapped"])
        if device == "cuda":
            # The first model's releases leave the group no arena: its window's rings go too
            # (this rank's: slots x chunk for the all-gather ring and per peer for the landing
            # rings), and come back for the next collective, which the results above cover.
            from torch_odc_backend import _C
            rings = _C.default_ring_slots * _C.default_chunk_bytes_cuda * (2 + 1)
            assert min(r["released"]["freed"]) >= rings, (rank, r["released"]["freed"], rings)
        m = r["misuse"]
        assert "between minibatches" in m["during"], m
        assert "released" in m["forward"] and "odc.restore" in m["forward"], m
        assert m["after"] is True
