"""Dynamic balancing (odc.balance.DynamicBalancer / DynamicBatchSampler), on CPU ("cpu:odc").

Ranks claim microbatches from one group-wide counter as they become free. Checked here:
every microbatch of every minibatch is trained exactly once over the ranks (no duplicates,
none lost) with random per-rank delays, over many rounds (counters of old rounds are
deleted) and with two balancers interleaved; a slow rank claims less; decoupled mode fed
by the claims ends each minibatch with the gradients of exact mode over the whole minibatch;
misuse raises clear errors. One spawned job per world size (spawning is slow on CI).

CUDA ("cpu:gloo,cuda:odc"): ranks take microbatches as their GPU frees up (CUDA events decide
when), each exactly once, a rank whose GPU is slowed takes less and is learned, and decoupled
mode fed this way ends each minibatch with exact mode's gradients. With one GPU the ranks
share it."""
from __future__ import annotations

import random
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp_models as fm
from dist_utils import GPU_ENV, cuda_case, run_distributed, run_once
from torch_odc_backend import balance

ROUNDS = 12
# microbatch counts per round: more than, equal to and fewer than the ranks, one, none
COUNTS = [9, 3, 1, 0, 2, 17, 5, 4, 3, 8, 1, 6]
STEPS = 3
LOSS_SCALE = 0.25
COST = balance.FittedCost(2.0, 1.0, 0.0)
GPU_N = max(2, min(torch.cuda.device_count(), 4))  # CUDA ranks
GPU_ROUNDS = 8
WORLDS = [("cpu", 2), ("cpu", 3), cuda_case("cuda", GPU_N, id=f"cuda-{GPU_N}")]


def lengths_of(r: int, which: int) -> list[int]:
    """Round r's sample lengths for balancer `which` of _exactly_once."""
    n = COUNTS[(r + which) % len(COUNTS)]
    return [random.Random(1000 * r + j).randint(1, 30) for j in range(n)]


def _exactly_once(rank, world):
    """Three balancers used in turn; rank 0 sleeps 3x longer per unit of cost."""
    rng = random.Random(100 + rank)
    first, second = balance.DynamicBalancer(), balance.DynamicBalancer(adapt=False)
    # each rank to its own queue (weighted by speeds), largest microbatch last
    own = balance.DynamicBalancer(take_from_others=False, largest_last=True)
    names = (first.name, second.name, own.name)
    taken, exhausted, plans = {0: [], 1: [], 2: []}, {0: [], 1: [], 2: []}, []
    for r in range(ROUNDS):
        for which, b in enumerate((first, second, own)):
            lengths = lengths_of(r, which)
            got, flags = [], []
            claims = b.minibatch(lengths, max_tokens=40, cost=COST)
            if b is own:
                plans.append(claims.plan)
            for mb in claims:
                flags.append(claims.exhausted())  # nothing left: mb is this rank's last
                time.sleep(0.0002 * COST([lengths[i] for i in mb]) * (3 if rank == 0 else 1)
                           * rng.uniform(0.8, 1.2))
                got.append(mb)
            taken[which].append(got)
            exhausted[which].append(flags)
        dist.barrier()  # the one synchronisation per round (odc.sync in decoupled mode)
    return {"taken": taken, "exhausted": exhausted, "names": names, "own_plans": plans,
            "slowdowns": [h["slowdowns"] for h in first.history],
            "own_slowdowns": [h["slowdowns"] for h in own.history]}


def _sampler_worker(rank, world):
    """DynamicBatchSampler over a dataset of lengths, loaded through a DataLoader per minibatch."""
    rng = random.Random(7)
    lengths = [rng.randint(1, 40) for _ in range(45)]
    cost = balance.FittedCost(1.0, 0.1, 0.01)
    sampler = balance.DynamicBatchSampler(lengths, max_tokens=64, minibatch_size=10, cost=cost, seed=3)
    static = balance.BalancedBatchSampler(lengths, world, rank, max_tokens=64, minibatch_size=10,
                                          cost=cost, seed=3)
    out = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        static.set_epoch(epoch)
        for index, claims in enumerate(sampler):
            mine = []
            loader = torch.utils.data.DataLoader(
                balance.MicrobatchDataset(list(range(len(lengths))), collate_fn=lambda xs: list(xs)),
                sampler=claims, batch_size=None)
            for micro in loader:
                time.sleep(0.002 * (1 + rank))
                mine.append(micro)
            assert claims.num_tokens == sum(lengths[i] for i in static.minibatch_indices(index))
            out.append({"mine": mine, "minibatch": static.minibatch_indices(index), "plan": claims.plan})
            dist.barrier()
    return out


def _train(mesh, *, dynamic: bool, seed_delays: int, device="cpu"):
    """Exact mode: every rank runs microbatches rank, rank + dp, ... of the step's 3 * dp.
    Dynamic: decoupled mode, ranks claim the step's microbatches (random delays)."""
    import torch_odc_backend as odc

    model, opt = fm.build(mesh, seed=3, device=device)
    dp, rank = dist.get_world_size(), dist.get_rank()
    if dynamic:
        odc.decouple(model, opt)
        balancer = balance.DynamicBalancer()
    rng = random.Random(seed_delays + rank)
    grads, claimed = [], []
    for step in range(STEPS):
        ids = [[m] for m in range(3 * dp)]
        # a token cap of 1: every sample is a microbatch of its own
        mine = balancer.minibatch([1] * (3 * dp), max_tokens=1, cost=COST) if dynamic else ids[rank::dp]
        got = []
        for (mb,) in mine:
            if dynamic:
                time.sleep(rng.uniform(0, 0.03))
            x, y = fm.batch(seed=7, dp_rank=mb, step=step, device=device)
            (F.cross_entropy(model(x).float(), y.reshape(-1)) * LOSS_SCALE).backward()
            got.append(mb)
        if dynamic:
            odc.sync(model)
        claimed.append(got)
        grads.append({n: p.grad.full_tensor().float().cpu() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"grads": grads, "params": fm.full_params(model), "claimed": claimed}


def _train_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    return fm.to_wire({"exact": _train(mesh, dynamic=False, seed_delays=0),
                       "dynamic": _train(mesh, dynamic=True, seed_delays=11)})


def _slowed_gpu(rank, world):
    """Rank 0's GPU spins 4x longer per unit of cost (queued work: the host does not wait)."""
    torch.cuda.set_device(rank % torch.cuda.device_count())
    b = balance.DynamicBalancer()
    assert b.device.type == "cuda"
    taken = []
    for r in range(GPU_ROUNDS):
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


def _gpu_train_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(rank % torch.cuda.device_count())
    mesh = init_device_mesh("cuda", (world,))
    return fm.to_wire({"exact": _train(mesh, dynamic=False, seed_delays=0, device="cuda"),
                       "dynamic": _train(mesh, dynamic=True, seed_delays=11, device="cuda")})


gpu_run = run_once(lambda fn: run_distributed({"slowed": _slowed_gpu, "train": _gpu_train_worker}[fn], GPU_N,
                                              backend="cpu:gloo,cuda:odc", env=GPU_ENV, deadline_s=300))


def _misuse_worker(rank, world):
    out = {}

    def expect(name, fn):
        try:
            fn()
            out[name] = None
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            out[name] = f"{type(e).__name__}: {e}"

    gloo = dist.new_group(backend="gloo")
    expect("gloo_group", lambda: balance.DynamicBalancer(gloo))
    expect("ahead", lambda: balance.DynamicBalancer(ahead=-1))
    expect("name", lambda: balance.DynamicBalancer(name="a/b"))
    b = balance.DynamicBalancer(name="once")
    expect("lengths", lambda: b.minibatch([1, 2], max_tokens=4, cost=COST, indices=[0]))
    claims = b.minibatch([1, 1], max_tokens=1, cost=COST)
    first = list(claims)
    out["second_pass"] = list(claims)  # an exhausted round yields nothing more
    out["first_pass_len"] = len(first)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def run():
    def job(world):
        try:
            return {"once": run_distributed(_exactly_once, world, backend="cpu:odc", deadline_s=200),
                    "sampler": run_distributed(_sampler_worker, world, backend="cpu:odc", deadline_s=200),
                    "train": run_distributed(_train_worker, world, backend="cpu:odc", deadline_s=200)}
        except AssertionError:
            return {"error": traceback.format_exc()}
    return run_once(job)


@pytest.mark.parametrize("device,world", WORLDS)
def test_every_microbatch_is_claimed_exactly_once_and_a_slow_rank_takes_less(run, device, world):
    if device == "cuda":  # rank 0's GPU is the slow one
        res = gpu_run("slowed")
        for r in range(GPU_ROUNDS):
            got = sorted(i for rank in res for mb in res[rank]["taken"][r] for i in mb)
            assert got == list(range(6 * world)), (r, got)
        work = {rank: sum(len(mb) for t in res[rank]["taken"] for mb in t) for rank in res}
        assert work[0] < min(work[r] for r in work if r != 0), work
        assert min(s[0] for s in res[0]["slowdowns"][3:]) > 1.5, res[0]["slowdowns"]
        return
    res = run(world)
    assert "error" not in res, res.get("error")
    once = res["once"]
    assert len({tuple(once[r]["names"]) for r in once}) == 1, "balancers named differently on ranks"
    for which in (0, 1, 2):
        for r in range(ROUNDS):
            n = COUNTS[(r + which) % len(COUNTS)]
            got = sorted(i for rank in once for mb in once[rank]["taken"][which][r] for i in mb)
            assert got == list(range(n)), (which, r, got)
            # exhausted(): only ever after a rank's last take, and true for the rank that took
            # the round's last item
            flags = {rank: once[rank]["exhausted"][which][r] for rank in once}
            assert all(not any(f[:-1]) for f in flags.values()), (which, r, flags)
            assert n == 0 or any(f and f[-1] for f in flags.values()), (which, r, flags)
    # take_from_others=False: each rank trains exactly its plan's share, cheapest microbatch
    # first, and knows its last one when it takes it
    for r in range(ROUNDS):
        for rank in once:
            plan = once[rank]["own_plans"][r][rank]
            got = once[rank]["taken"][2][r]
            assert got == plan, (r, rank, got, plan)
            costs = [COST([lengths_of(r, 2)[i] for i in mb]) for mb in plan]
            assert costs == sorted(costs), (r, rank, costs)
            assert once[rank]["exhausted"][2][r] == [False] * (len(got) - 1) + [True] * bool(got)
    assert max(s[0] for s in once[0]["own_slowdowns"][2:]) > 1.5, once[0]["own_slowdowns"]
    # the rank that is 3x slower takes less than an even share over all rounds (not necessarily
    # less than each other rank: on 2 cores another of 3 ranks can lose as much time to the OS)
    work = {rank: sum(len(mb) for w in (0, 1) for t in once[rank]["taken"][w] for mb in t) for rank in once}
    assert work[0] < sum(work.values()) / world, work
    # the adaptive balancer learned it: from round 1 on its plans see rank 0 as slower
    slow = once[0]["slowdowns"]
    assert slow[0] == [1.0] * world
    assert all(once[rank]["slowdowns"] == slow for rank in once), "plans differ across ranks"
    # (timing on a loaded 2-core machine is noisy: the slow rank must stand out, not the rest be 1)
    assert all(s[0] > 1.5 and s[0] == max(s) for s in slow[2:]), slow


@pytest.mark.parametrize("world", [2, 3])
def test_sampler_claims_cover_each_minibatch(run, world):
    res = run(world)
    assert "error" not in res, res.get("error")
    sampler = res["sampler"]
    for k, ref in enumerate(sampler[0]):
        claimed = [x for rank in sampler for mb in sampler[rank][k]["mine"] for x in mb]
        assert sorted(claimed) == sorted(ref["minibatch"]), f"minibatch {k}"
        assert all(sampler[rank][k]["plan"] == ref["plan"] for rank in sampler), "plans differ"
        assert sorted(i for p in ref["plan"] for mb in p for i in mb) == sorted(ref["minibatch"])


def assert_dynamic_equals_exact(train: dict, world: int) -> None:
    """Each step's microbatches were claimed exactly once; after every odc.sync the dynamic
    run's gradients (and the final parameters) equal exact mode's."""
    for step in range(STEPS):
        got = sorted(m for rank in train for m in train[rank]["dynamic"]["claimed"][step])
        assert got == list(range(3 * world))
    for rank in train:
        exact, dyn = train[rank]["exact"], train[rank]["dynamic"]
        for step in range(STEPS):
            for name, ref in exact["grads"][step].items():
                torch.testing.assert_close(torch.as_tensor(dyn["grads"][step][name]), torch.as_tensor(ref),
                                           rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"rank {rank} step {step} grad {name}: {m}")
        for name, ref in exact["params"].items():
            torch.testing.assert_close(torch.as_tensor(dyn["params"][name]), torch.as_tensor(ref),
                                       rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device,world", WORLDS)
def test_dynamic_decoupled_gradients_equal_exact_mode(run, device, world):
    if device == "cuda":
        assert_dynamic_equals_exact(gpu_run("train"), world)
        return
    res = run(world)
    assert "error" not in res, res.get("error")
    assert_dynamic_equals_exact(res["train"], world)


def test_misuse_is_reported():
    res = run_distributed(_misuse_worker, 2, backend="cpu:odc", deadline_s=120)
    for rank, out in res.items():
        assert "group whose backend is odc" in out["gloo_group"], out
        assert "ahead must be" in out["ahead"], out
        assert "name must be" in out["name"], out
        assert out["second_pass"] == []
        assert "indices has 1 entries for 2 lengths" in out["lengths"], out
    assert sum(out["first_pass_len"] for out in res.values()) == 2


def test_balance_bound():
    assert balance.balance_bound([4, 2, 2], [1, 1]) == 4  # the largest microbatch alone
    assert balance.balance_bound([3, 3, 2], [1, 1]) == 4  # the work spread evenly
    # a rank 1.3x slower: speeds 1 and 1/1.3 share 8 units
    assert balance.balance_bound([2, 2, 2, 2], [1, 1.3]) == pytest.approx(8 / (1 + 1 / 1.3))
    assert balance.balance_bound([], [1, 1]) == 0.0
    with pytest.raises(ValueError, match="slowdowns"):
        balance.balance_bound([1], [0])
    with pytest.raises(ValueError, match="costs"):
        balance.balance_bound([-1], [1])


def test_lb_mini_weighted():
    rng = random.Random(4)
    lengths = [rng.randint(1, 500) for _ in range(40)]
    cost = balance.FittedCost(5.0, 1.0, 0.001)
    assert balance.lb_mini_weighted(lengths, [1.0, 1.01], 1000, cost) == balance.lb_mini(lengths, 2, 1000, cost)
    plan = balance.lb_mini_weighted(lengths, [1.0, 1.5, 1.0], 1000, cost)
    assert sorted(i for p in plan for mb in p for i in mb) == list(range(40))
    total = [sum(cost([lengths[i] for i in mb]) for mb in p) for p in plan]
    times = [t * f for t, f in zip(total, [1.0, 1.5, 1.0])]
    assert total[1] < 0.8 * min(total[0], total[2]), total  # the slow rank gets less work
    assert max(times) < 1.1 * min(times), times  # and the ranks' times come out even
    with pytest.raises(ValueError, match="slowdowns"):
        balance.lb_mini_weighted(lengths, [], 1000, cost)


def test_dynamic_sampler_validates_without_a_group():
    with pytest.raises(ValueError, match="max_tokens"):
        balance.DynamicBatchSampler([5, 100], max_tokens=64, minibatch_size=2, cost=lambda d: 1.0)
    with pytest.raises(RuntimeError, match="initialised process group"):
        balance.DynamicBatchSampler([5, 10], max_tokens=64, minibatch_size=2, cost=lambda d: 1.0)
