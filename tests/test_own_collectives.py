"""The collectives odc serves itself (all-reduce, reduce, broadcast, all-gather, reduce-scatter
lists, all-to-all, scatter, gather, barrier, the object collectives built on them): what
it does for CUDA tensors when ranks share a GPU (NCCL refuses that) or torch lacks NCCL.
ODC_SELF_SERVE=1 turns it on for CPU tensors too, so CI runs it here against references
computed from each rank's known inputs. The GPU version runs in tests/test_collectives.py (its CUDA part).

Small rings (4 KiB chunks, 2 slots) make the larger cases wrap the ring many times."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed, run_once
from test_collectives import SMALL_RING

OWN = {**SMALL_RING, "ODC_SELF_SERVE": "1"}
R = dist.ReduceOp
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64,
          torch.uint8, torch.int8]
OPS = {"sum": R.SUM, "avg": R.AVG, "max": R.MAX, "min": R.MIN, "product": R.PRODUCT}
SIZES = [1, 7, 1001, 5000]  # elements; 5000 fp32 is 5 chunks of the small ring


def _value(rank: int, n: int, dtype, seed: int) -> torch.Tensor:
    """Rank r's input: small values that stay exact in every dtype under every op."""
    g = torch.Generator().manual_seed(seed * 131 + rank)
    if dtype.is_floating_point:
        return (torch.randint(-8, 9, (n,), generator=g).to(torch.float64) / 4).to(dtype)
    lo = 0 if dtype == torch.uint8 else -3
    return torch.randint(lo, 4, (n,), generator=g).to(dtype)


def _reduce_ref(values, op: str, dtype):
    acc = values[0].to(torch.float64 if dtype.is_floating_point else torch.int64)
    for v in values[1:]:
        v = v.to(acc.dtype)
        acc = {"sum": acc + v, "avg": acc + v, "max": torch.maximum(acc, v),
               "min": torch.minimum(acc, v), "product": acc * v}[op]
    if op == "avg":  # odc (like NCCL) multiplies by 1/world in the accumulation type
        scale_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        acc = acc.to(scale_dtype) * torch.tensor(1 / len(values), dtype=scale_dtype)
    return acc.to(dtype)


def _cases():
    cases = []
    for d in DTYPES:
        for op in OPS:
            if op == "avg" and not d.is_floating_point:
                continue
            for n in SIZES:
                cases.append((d, op, n))
    return cases


def run_all(rank, world, dev):
    """Every case on `dev` against its reference: {"errors": [...], "stats": odc's counters}.
    Inputs are built on the CPU and moved; results are compared on the CPU."""
    from torch_odc_backend import backend_stats

    out = {"errors": []}
    err = out["errors"].append
    on = lambda t: t.to(dev, copy=True)  # noqa: E731
    same = lambda got, want: torch.equal(got.cpu(), want.cpu())  # noqa: E731

    # all-reduce (and reduce: the root gets the result, the others keep their input)
    for i, (dtype, op, n) in enumerate(_cases()):
        vals = [_value(r, n, dtype, i) for r in range(world)]
        want = _reduce_ref(vals, op, dtype)
        t = on(vals[rank])
        work = dist.all_reduce(t, op=OPS[op], async_op=i % 2 == 1)
        if work is not None:
            work.wait()
        if not same(t, want):
            err(f"all_reduce {dtype} {op} n={n}: {t[:4].tolist()} want {want[:4].tolist()}")
        if i % 5 == 0:
            root = i % world
            t = on(vals[rank])
            dist.reduce(t, dst=root, op=OPS[op])
            if not same(t, want if rank == root else vals[rank]):
                err(f"reduce {dtype} {op} n={n} root={root}")
    # bool all-reduce: SUM is a logical or, PRODUCT a logical and (as NCCL)
    b = torch.tensor([rank == 0, True, False, rank == 1])
    t = on(b)
    dist.all_reduce(t, op=R.SUM)
    if t.tolist() != [True, True, False, True]:
        err(f"bool SUM: {t.tolist()}")
    t = on(b)
    dist.all_reduce(t, op=R.PRODUCT)
    if t.tolist() != [False, True, False, False]:
        err(f"bool PRODUCT: {t.tolist()}")
    # a 2-D, non-divisible all-reduce keeps its shape
    t = on(torch.full((3, 5), float(rank + 1)))
    dist.all_reduce(t)
    if not same(t, torch.full((3, 5), float(world * (world + 1) // 2))):
        err("2-D all_reduce")
    # dense but not contiguous (channels-last): reduced and broadcast as its memory's elements,
    # as NCCL does; the layout stays
    x = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).view(2, 3, 4, 5)
    t = on(x * (rank + 1)).to(memory_format=torch.channels_last)
    dist.all_reduce(t)
    if not (same(t, x * (world * (world + 1) // 2)) and t.is_contiguous(memory_format=torch.channels_last)):
        err("channels-last all_reduce")
    t = on(x * (rank + 1)).to(memory_format=torch.channels_last)
    dist.broadcast(t, src=world - 1)
    if not same(t, x * world):
        err("channels-last broadcast")

    # broadcast from every root, several sizes, bitwise
    for root in range(world):
        for n in (0, 3, 4097, 20_000):
            src = _value(root, n, torch.float32, 7 + n) * (root + 1)
            t = on(src if rank == root else torch.full((n,), float("nan")))
            dist.broadcast(t, src=root)
            if not same(t, src):
                err(f"broadcast root={root} n={n}")

    # all-gather (list): even and uneven sizes
    for n in (1, 3000):
        outs = [on(torch.empty(n, dtype=torch.bfloat16)) for _ in range(world)]
        dist.all_gather(outs, on(_value(rank, n, torch.bfloat16, 11)))
        for r in range(world):
            if not same(outs[r], _value(r, n, torch.bfloat16, 11)):
                err(f"all_gather even n={n} from {r}")
    sizes = [2 + 1500 * r for r in range(world)]
    outs = [on(torch.empty(sizes[r], dtype=torch.int64)) for r in range(world)]
    dist.all_gather(outs, on(torch.arange(sizes[rank]) + 100 * rank))
    for r in range(world):
        if not same(outs[r], torch.arange(sizes[r]) + 100 * r):
            err(f"all_gather uneven from {r}")

    # reduce-scatter (list form), MAX
    n = 1200
    got = on(torch.empty(n))
    dist.reduce_scatter(got, [on(_value(rank, n, torch.float32, 20 + p)) for p in range(world)], op=R.MAX)
    want = _reduce_ref([_value(r, n, torch.float32, 20 + rank) for r in range(world)], "max", torch.float32)
    if not same(got, want):
        err("reduce_scatter list MAX")

    # all-to-all: equal parts, uneven splits (with empty ones), and the list form
    rows = 6 * world
    base = torch.arange(rows * 3, dtype=torch.float32).view(rows, 3)
    y = on(torch.empty(rows, 3))
    dist.all_to_all_single(y, on(base + 1000 * rank))
    for p in range(world):
        if not same(y[6 * p:6 * p + 6], base[6 * rank:6 * rank + 6] + 1000 * p):
            err(f"all_to_all_single equal, from {p}")
    split = lambda src, dst: (src + 2 * dst) % 3 * 700  # noqa: E731  rows src sends dst (0 too)
    send = [split(rank, p) for p in range(world)]
    recv = [split(p, rank) for p in range(world)]
    x = torch.cat([torch.full((send[p], 2), float(rank * 10 + p)) for p in range(world)])
    y = on(torch.empty(sum(recv), 2))
    dist.all_to_all_single(y, on(x), output_split_sizes=recv, input_split_sizes=send)
    if not same(y, torch.cat([torch.full((recv[p], 2), float(p * 10 + rank)) for p in range(world)])):
        err("all_to_all_single uneven")
    ins = [on(torch.full((p + 1,), rank * 100 + p, dtype=torch.int32)) for p in range(world)]
    outs = [on(torch.empty(rank + 1, dtype=torch.int32)) for _ in range(world)]
    dist.all_to_all(outs, ins)
    for p in range(world):
        if not same(outs[p], torch.full((rank + 1,), p * 100 + rank, dtype=torch.int32)):
            err(f"all_to_all list from {p}")

    # scatter and gather from every root
    for root in range(world):
        got = on(torch.empty(2500))
        scatter_list = ([on(torch.full((2500,), float(root * 10 + p))) for p in range(world)]
                        if rank == root else None)
        dist.scatter(got, scatter_list, src=root)
        if not same(got, torch.full((2500,), float(root * 10 + rank))):
            err(f"scatter root={root}")
        gather_list = [on(torch.empty(3, dtype=torch.int64)) for _ in range(world)] if rank == root else None
        dist.gather(on(torch.full((3,), rank * 7 + root)), gather_list, dst=root)
        if rank == root and any(not same(gather_list[p], torch.full((3,), p * 7 + root))
                                for p in range(world)):
            err(f"gather root={root}")

    # the object collectives (all-gather and broadcast of byte tensors underneath; with
    # "cpu:gloo,cuda:odc" they run on the CPU backend)
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "pad": "x" * (50 * rank)})
    if [o["rank"] for o in objs] != list(range(world)):
        err(f"all_gather_object: {objs}")
    box = [{"from": 0, "big": list(range(3000))}] if rank == 0 else [None]
    dist.broadcast_object_list(box, src=0)
    if box[0]["from"] != 0 or box[0]["big"][-1] != 2999:
        err("broadcast_object_list")
    if dev.type == "cuda":
        dist.barrier(device_ids=[dev.index])
    else:
        dist.barrier()

    out["stats"] = backend_stats(device=dev.type)
    return out


def _worker(rank, world):
    return run_all(rank, world, torch.device("cpu"))


def assert_results(res, device="cpu"):
    """Every case right, and odc (not the inner backend) served every collective on `device`."""
    errors = [f"rank {r}: {e}" for r in sorted(res) for e in res[r]["errors"]]
    assert not errors, f"{len(errors)} wrong results:\n" + "\n".join(errors[:40])
    for rank, out in res.items():
        s = out["stats"]
        assert s.get("delegated_ops", 0) == 0, (device, s)
        for key in ("own_all_reduce_ops", "own_reduce_ops", "own_broadcast_ops", "own_all_gather_ops",
                    "own_reduce_scatter_ops", "own_exchange_ops", "own_barrier_ops"):
            assert s.get(key, 0) > 0, (device, key, s)


@pytest.fixture(scope="module")
def run():
    return run_once(lambda world: run_distributed(_worker, world, env=OWN, deadline_s=300))


@pytest.mark.parametrize("world", [2, 3])
def test_own_collectives_equal_references(run, world):
    assert_results(run(world))


def _default_worker(rank, world):
    """Without the knob, CPU tensors' other collectives still go to gloo."""
    from torch_odc_backend import backend_stats

    t = torch.ones(4)
    dist.all_reduce(t)
    return t.tolist(), backend_stats()


def test_default_delegates_cpu_collectives():
    for rank, (t, stats) in run_distributed(_default_worker, 2, deadline_s=120).items():
        assert t == [2.0] * 4
        assert stats.get("delegated_ops", 0) == 1 and "own_all_reduce_ops" not in stats, stats


def _mismatch_worker(rank, world):
    """Self-served collectives check their peers' descriptors too. Two ranks that each name
    themselves the root of a broadcast read nothing from each other: the next collective of
    the group finds their chunk counts out of step."""
    out = {}
    for name, fn in {
        "all_reduce_op": lambda g: dist.all_reduce(torch.ones(8), op=R.SUM if rank else R.MAX, group=g),
        "broadcast_root": lambda g: dist.broadcast(torch.ones(8), src=rank % 2, group=g),
        # rank 1 sends rank 0 three elements where rank 0 expects two
        "all_to_all_split": lambda g: dist.all_to_all_single(
            torch.empty(2 * world), torch.ones(2 * world + rank),
            output_split_sizes=[2] * world, input_split_sizes=[2 + rank] + [2] * (world - 1),
            group=g),
    }.items():
        g = dist.new_group(list(range(world)))
        try:
            fn(g)
            dist.all_reduce(torch.ones(4), group=g)
            out[name] = None
        except Exception as exc:  # noqa: BLE001
            out[name] = str(exc)
    return out


def test_self_served_mismatch_is_reported():
    res = run_distributed(_mismatch_worker, 2, env=OWN, timeout_s=30, deadline_s=120)
    for rank, out in res.items():
        for name, msg in out.items():
            assert msg is not None, (rank, name)
            if name == "all_to_all_split" and rank == 1:
                continue  # what rank 1 received is what it expected: rank 0 reports the pair
                          # (and rank 1's next collective fails, as here, with rank 0 gone)
            # broadcast_root: the next collective meets the other root's broadcast chunk (a
            # different collective) or a chunk out of step
            assert "issued a different collective" in msg or (
                name == "broadcast_root" and "no longer in step" in msg), (rank, name, msg)
