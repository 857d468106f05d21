"""Dynamic balancing on GPUs ("cpu:gloo,cuda:odc"): ranks take microbatches as their GPU
frees up (CUDA events decide when), each exactly once, a rank whose GPU is slowed takes
less and is learned, and decoupled mode fed this way ends each minibatch with exact mode's
gradients. With one GPU the ranks share it. Skipped (loudly) without a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fsdp_models as fm
from dist_utils import GPU_ENV, run_distributed, run_once
from test_dynamic_balance import COST, _train, assert_dynamic_equals_exact

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")

N = max(2, min(torch.cuda.device_count(), 4))  # ranks
ROUNDS = 8


def _slowed_gpu(rank, world):
    """Rank 0's GPU spins 4x longer per unit of cost (queued work: the host does not wait)."""
    from torch_odc_backend import balance

    torch.cuda.set_device(rank % torch.cuda.device_count())
    b = balance.DynamicBalancer()
    assert b.device.type == "cuda"
    taken = []
    for r in range(ROUNDS):
        lengths = [(7 * r + 3 * j) % 23 + 1 for j in range(6 * world)]
        got = []
        for mb in b.minibatch(lengths, max_tokens=30, cost=COST):
            cycles = int(2e5 * COST([lengths[i] for i in mb]) * (4 if rank == 0 else 1))
            torch.cuda._sleep(cycles)
            got.append(mb)
        torch.cuda.synchronize()
        dist.barrier()
        taken.append(got)
    return {"taken": taken, "slowdowns": [h["slowdowns"] for h in b.history]}


def _train_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(rank % torch.cuda.device_count())
    mesh = init_device_mesh("cuda", (world,))
    return fm.to_wire({"exact": _train(mesh, dynamic=False, seed_delays=0, device="cuda"),
                       "dynamic": _train(mesh, dynamic=True, seed_delays=11, device="cuda")})


run = run_once(lambda fn: run_distributed({"slowed": _slowed_gpu, "train": _train_worker}[fn], N,
                                          backend="cpu:gloo,cuda:odc", env=GPU_ENV, deadline_s=300))


def test_gpu_claims_exactly_once_and_a_slowed_gpu_takes_less():
    res = run("slowed")
    for r in range(ROUNDS):
        got = sorted(i for rank in res for mb in res[rank]["taken"][r] for i in mb)
        assert got == list(range(6 * N)), (r, got)
    work = {rank: sum(len(mb) for t in res[rank]["taken"] for mb in t) for rank in res}
    assert work[0] < min(work[r] for r in work if r != 0), work
    assert min(s[0] for s in res[0]["slowdowns"][3:]) > 1.5, res[0]["slowdowns"]


def test_gpu_dynamic_decoupled_gradients_equal_exact_mode():
    assert_dynamic_equals_exact(run("train"), N)
