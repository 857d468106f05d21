"""Decoupled mode with ranks that never use a module: a two-tower model (a text tower and an
image tower, each its own FSDP module, feeding one head) where one rank's microbatches are all
text-only, so it never runs the image tower's forward or backward, and so never gathers its
parameters nor reduces its gradients. After odc.sync every rank's gradients equal one process
that ran every microbatch on the unsharded model. (Exact mode cannot do this: its per-layer
collectives need every rank.)

CPU ("cpu:odc", 2 ranks) and CUDA ("cpu:gloo,cuda:odc", 2 ranks)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_utils import GPU_ENV, cuda_case, run_distributed

import pytest

DIM, VOCAB, PATCH, STEPS = 24, 31, 12, 2
# microbatch id -> has an image; 6 per step. Rank 0 runs the text-only ones, rank 1 the rest.
HAS_IMAGE = [False, False, True, False, True, True]
LOSS_SCALE = 1.0 / len(HAS_IMAGE)


class TwoTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.text = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM), nn.GELU())
        self.image = nn.Sequential(nn.Linear(PATCH, DIM), nn.GELU(), nn.Linear(DIM, DIM))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens, patches=None):
        h = self.text(tokens)                       # (B, T, D)
        if patches is not None:                     # an image: its summary joins every position
            h = h + self.image(patches).mean(dim=1, keepdim=True)
        return self.head(h)


def _microbatch(mb: int, step: int, device):
    g = torch.Generator().manual_seed(1000 * step + mb)
    tokens = torch.randint(0, VOCAB, (2, 9), generator=g)
    patches = torch.randn(2, 4, PATCH, generator=g) if HAS_IMAGE[mb] else None
    to = (lambda t: None if t is None else t.to(device))
    return to(tokens[:, :-1]), to(patches), to(tokens[:, 1:])


def _loss(model, mb, step, device):
    x, patches, y = _microbatch(mb, step, device)
    logits = model(x, patches)
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1)) * LOSS_SCALE


def _new_model(device):
    torch.manual_seed(11)
    return TwoTower().to(device)


def _reference(device):
    """One process, every microbatch, the unsharded model: the gradients of each step."""
    model = _new_model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(STEPS):
        for mb in range(len(HAS_IMAGE)):
            _loss(model, mb, step, device).backward()
        for p in model.parameters():  # FSDP2 divides by the ranks (2); one process only sums
            p.grad.div_(2)
        grads.append({n: p.grad.cpu() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return grads


def _worker(rank, world, device_type):
    import torch_odc_backend as odc
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = torch.device(device_type, rank % torch.cuda.device_count()) if device_type == "cuda" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device_type, (world,))
    model = _new_model(device)
    for tower in (model.text, model.image):
        fully_shard(tower, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    odc.decouple(model, opt)
    mine = [mb for mb in range(len(HAS_IMAGE)) if HAS_IMAGE[mb] == (rank == 1)]
    grads = []
    for step in range(STEPS):
        for mb in mine:
            _loss(model, mb, step, device).backward()
        odc.sync(model)
        grads.append({n: p.grad.full_tensor().cpu() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"grads": grads, "image_used": any(HAS_IMAGE[mb] for mb in mine),
            "reference": _reference(device) if rank == 0 else None}


def _check(res):
    assert res[0]["image_used"] is False and res[1]["image_used"] is True  # the case is what it says
    ref = res[0]["reference"]
    for rank in sorted(res):
        for step in range(STEPS):
            for name, want in ref[step].items():
                torch.testing.assert_close(res[rank]["grads"][step][name], want, rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"rank {rank} step {step} {name}: {m}")


@pytest.mark.parametrize("device", ["cpu", cuda_case("cuda", gpus=2, id="cuda")])
def test_rank_that_never_uses_a_tower_gets_exact_gradients(device):
    backend = "cpu:odc" if device == "cpu" else "cpu:gloo,cuda:odc"
    env = GPU_ENV if device == "cuda" else None
    _check(run_distributed(_worker, 2, device, backend=backend, env=env, deadline_s=240))
