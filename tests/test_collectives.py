"""CPU correctness of the "odc" backend against references every rank computes itself.

Every rank regenerates every rank's input from a seed, so it can compute the exact
expected all-gather output and a float64 reduce-scatter reference locally. Many cases
run back-to-back in one spawned group (spawning is the expensive part on 2 CI cores),
each worker returns a list of human-readable mismatches, and the test asserts it is empty.

The helpers (make_input, poisoned, ag_case, rs_case, check_*) are reused by
test_gpu_collectives.py.
"""
from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from dist_utils import run_distributed

SMALL_RING = {"ODC_CHUNK_BYTES": "4096", "ODC_RING_SLOTS": "2"}
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
AG_DTYPES = FLOATS + [torch.uint8, torch.int64]
# Per-rank element counts. With 4096-byte chunks: 1024 fp32 / 2048 bf16 / 512 int64 per chunk,
# so these cover empty and single-element ops, odd sizes, exact chunk multiples, +1 past a chunk, and
# ops that stream through hundreds of chunks (the ring wraps many times).
SIZES = [0, 1, 7, 1001, 1024, 2049, 20_011, 150_001]
RS_OPS = ["sum", "avg", "premul_float", "premul_tensor"]
PREMUL_FACTORS = [2.5, -0.75, 1 / 3]
# (rtol, atol): err <= atol + rtol * magnitude, magnitude = |scale| * sum_r |x_r| (>= |ref|).
# bf16/fp16 leave room for rounding of the scaled inputs, partial sums and the final result.
RS_TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1e-2, 1e-5), torch.float16: (2e-3, 1e-5)}
GUARD = 5  # poisoned elements after every output, must stay untouched


# ----------------------------------------------------------------------------- helpers
def make_input(seed: int, numel: int, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """Deterministic in (seed, numel, dtype, device type): every rank can rebuild any rank's input."""
    g = torch.Generator(device=device).manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, device=device).to(dtype)
    lo, hi = (0, 256) if dtype == torch.uint8 else (-(2**62), 2**62)
    return torch.randint(lo, hi, (numel,), generator=g, dtype=dtype, device=device)


def poisoned(numel: int, dtype: torch.dtype, offset: int = 0, device="cpu"):
    """A contiguous view of `numel` poisoned elements at `offset` inside a larger poisoned
    buffer; returns (buffer, view, pristine copy of the buffer) to detect stray writes."""
    buf = torch.empty(offset + numel + GUARD, dtype=dtype, device=device)
    buf.fill_(float("nan") if dtype.is_floating_point else (0xA5 if dtype == torch.uint8 else -0x5A5A5A5A5A5A5A5B))
    return buf, buf[offset : offset + numel], buf.clone()


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def first_diff(got: torch.Tensor, want: torch.Tensor, bad: torch.Tensor) -> str:
    idx = int(bad.reshape(-1).nonzero()[0])
    return (f"{int(bad.sum())}/{bad.numel()} elements wrong, first at [{idx}]: "
            f"got {got.reshape(-1)[idx].item()!r} want {want.reshape(-1)[idx].item()!r}")


def check_untouched(buf, pristine, offset, numel, what) -> list[str]:
    ok = torch.equal(raw(buf[:offset]), raw(pristine[:offset])) and torch.equal(
        raw(buf[offset + numel :]), raw(pristine[offset + numel :]))
    return [] if ok else [f"{what}: wrote outside the output tensor"]


def check_equal(got, want, what) -> list[str]:
    want = want.to(got.device)
    if got.shape == want.shape and torch.equal(raw(got), raw(want)):
        return []
    if got.shape != want.shape:
        return [f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"]
    bad = (raw(got).view(-1, got.element_size()) != raw(want).view(-1, want.element_size())).any(1)
    return [f"{what}: not bitwise equal: {first_diff(got, want, bad)}"]


def check_close(got, ref64, mag, dtype, what) -> list[str]:
    rtol, atol = RS_TOL[dtype]
    ref64, mag = ref64.to(got.device), mag.to(got.device)
    if got.shape != ref64.shape:
        return [f"{what}: shape {tuple(got.shape)} != {tuple(ref64.shape)}"]
    bad = ~((got.double() - ref64).abs() <= atol + rtol * mag)  # NaN (unwritten) counts as bad
    return [f"{what}: {first_diff(got.double(), ref64, bad)}"] if bad.any() else []


def reduce_op(name: str, factor: float, world: int, dtype, device="cpu"):
    """(ReduceOp, effective scale) for a reduce-scatter case."""
    if name == "sum":
        return dist.ReduceOp.SUM, 1.0
    if name == "avg":
        return dist.ReduceOp.AVG, 1.0 / world
    if name == "premul_float":
        return dist._make_nccl_premul_sum(factor), factor
    # 0-dim tensor factor: NCCL takes it in the data dtype, except fp32 for bf16 data
    t = torch.tensor(factor, dtype=torch.float32 if dtype == torch.bfloat16 else dtype, device=device)
    return dist._make_nccl_premul_sum(t), float(t)


def ag_case(seed, n, dtype, rank, world, offset=0, inplace=False, device="cpu"):
    """Inputs and poisoned output for all_gather_into_tensor. With inplace=True the input is
    the rank's slice of the output (how FSDP2 calls it)."""
    xs = [make_input(seed + r, n, dtype, device) for r in range(world)]
    buf, out, pristine = poisoned(world * n, dtype, offset, device)
    if inplace:
        inp = out[rank * n : (rank + 1) * n]
    else:
        _, inp, _ = poisoned(n, dtype, (offset + 3) % 4, device)
    inp.copy_(xs[rank])
    return dict(buf=buf, out=out, pristine=pristine, inp=inp, src=xs[rank],
                want=torch.cat(xs), offset=offset, inplace=inplace)


def rs_case(seed, n, dtype, rank, world, op="sum", factor=1.0, offset=0, device="cpu"):
    """Inputs, poisoned output and float64 reference for reduce_scatter_tensor."""
    xs = [make_input(seed + r, world * n, dtype, device) for r in range(world)]
    redop, scale = reduce_op(op, factor, world, dtype, device)
    mine = [x[rank * n : (rank + 1) * n].double() for x in xs]
    buf, out, pristine = poisoned(n, dtype, offset, device)
    _, inp, _ = poisoned(world * n, dtype, (offset + 1) % 4, device)
    inp.copy_(xs[rank])
    return dict(buf=buf, out=out, pristine=pristine, inp=inp, src=xs[rank], redop=redop,
                ref=sum(mine) * scale, mag=sum(m.abs() for m in mine) * abs(scale), offset=offset,
                inplace=False)


def check_case(c, what) -> list[str]:
    """Validate a finished ag_case / rs_case."""
    errs = check_untouched(c["buf"], c["pristine"], c["offset"], c["out"].numel(), what)
    if "want" in c:
        errs += check_equal(c["out"], c["want"], what)
    else:
        errs += check_close(c["out"], c["ref"], c["mag"], c["out"].dtype, what)
    if not c["inplace"]:
        errs += check_equal(c["inp"], c["src"], what + " (input was modified)")
    return errs


def ready(t):
    """Materialize a functional-collective result."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else funcol.wait_tensor(t)


def wait(work, how: str):
    if how == "future":
        work.get_future().wait()
    else:
        work.wait()


# ----------------------------------------------------------------------------- random sweep
def make_cases(seed: int) -> list[dict]:
    """The same shuffled op list on every rank (depends on the seed only)."""
    rng = random.Random(seed)
    cases = [dict(kind="ag", dtype=d, n=n) for d in AG_DTYPES for n in SIZES]
    combos = [(d, op) for d in FLOATS for op in RS_OPS]
    cases += [dict(kind="rs", dtype=d, op=op, n=SIZES[(2 * i + j) % len(SIZES)])
              for i, (d, op) in enumerate(combos) for j in range(2)]
    rng.shuffle(cases)
    for i, c in enumerate(cases):
        c.update(idx=i, seed=seed * 100_003 + i * 101, async_op=rng.random() < 0.5,
                 wait=rng.choice(["work", "future"]), drain=rng.random() < 0.5,
                 offset=rng.randrange(4), inplace=c["kind"] == "ag" and rng.random() < 0.4,
                 factor=rng.choice(PREMUL_FACTORS))
    return cases


def _describe(c):
    keys = ("idx", "kind", "dtype", "n", "op", "factor", "async_op", "wait", "offset", "inplace")
    return " ".join(f"{k}={c[k]}" for k in keys if k in c)


def _sweep_worker(rank, world, seed):
    delays = random.Random(seed * 7919 + rank)  # per-rank jitter
    errors, pending = [], []

    def finish(c, st, work):
        if work is not None:
            wait(work, c["wait"])
        errors.extend(check_case(st, _describe(c)))

    cases = make_cases(seed)
    for c in cases:
        time.sleep(delays.uniform(0, 0.02))
        if c["kind"] == "ag":
            st = ag_case(c["seed"], c["n"], c["dtype"], rank, world, c["offset"], c["inplace"])
            work = dist.all_gather_into_tensor(st["out"], st["inp"], async_op=c["async_op"])
        else:
            st = rs_case(c["seed"], c["n"], c["dtype"], rank, world, c["op"], c["factor"], c["offset"])
            work = dist.reduce_scatter_tensor(st["out"], st["inp"], op=st["redop"], async_op=c["async_op"])
        if not c["async_op"]:
            assert work is None
            finish(c, st, None)  # a sync op completes before returning, even with async ops in flight
        else:
            pending.append((c, st, work))
            if c["drain"]:  # otherwise several async ops stay in flight
                for p in pending:
                    finish(*p)
                pending.clear()
    for p in pending:
        finish(*p)
    return dict(errors=errors, ops=len(cases))


@pytest.mark.parametrize(
    "world,env",
    [(2, SMALL_RING), (3, {"ODC_CHUNK_BYTES": "8192", "ODC_RING_SLOTS": "3"}), (4, SMALL_RING), (2, {})],
    ids=["w2-chunk4k-slots2", "w3-chunk8k-slots3", "w4-chunk4k-slots2", "w2-default-env"],
)
def test_random_sweep(world, env):
    seed = 1000 + 10 * world + len(env)
    res = run_distributed(_sweep_worker, world, seed, env=env, timeout_s=30, deadline_s=240)
    n_ops = len(make_cases(seed))
    assert n_ops > 2 * int(env.get("ODC_RING_SLOTS", 4))
    assert all(r["ops"] == n_ops for r in res.values())
    errors = [f"rank {r}: {e}" for r in sorted(res) for e in res[r]["errors"]]
    assert not errors, f"{len(errors)} mismatches:\n" + "\n".join(errors[:40])


# ----------------------------------------------------------------------------- coalesced / delegated
def _functional_coalesced(rank, world, seed):
    """all_gather / reduce_scatter coalesced through the functional collectives (mixed dtypes, 2-D)."""
    ag_coal = getattr(funcol, "all_gather_single_coalesced", None) or funcol.all_gather_into_tensor_coalesced
    rs_coal = getattr(funcol, "reduce_scatter_single_coalesced", None) or funcol.reduce_scatter_tensor_coalesced
    shapes = [((7,), torch.float32), ((1000, 3), torch.bfloat16), ((1,), torch.uint8), ((513,), torch.int64),
              ((4097,), torch.float16)]
    ins = [make_input(seed + 10 * i + rank, int(torch.Size(s).numel()), d).view(s) for i, (s, d) in enumerate(shapes)]
    outs = [ready(o) for o in ag_coal(ins, dist.group.WORLD)]
    errors = []
    for i, ((s, d), o) in enumerate(zip(shapes, outs)):
        n = int(torch.Size(s).numel())
        want = torch.cat([make_input(seed + 10 * i + r, n, d).view(s) for r in range(world)])
        errors += check_equal(o, want, f"functional coalesced AG #{i} {s} {d}")
    for red in ["sum", "avg"]:
        shapes = [((world * 5, 3), torch.float32), ((world * 1001,), torch.bfloat16), ((world,), torch.float16)]
        per = [[make_input(seed + 7 * i + r, int(torch.Size(s).numel()), d).view(s) for r in range(world)]
               for i, (s, d) in enumerate(shapes)]
        outs = [ready(o) for o in rs_coal([p[rank] for p in per], red, [0] * len(per), dist.group.WORLD)]
        for (s, d), p, o in zip(shapes, per, outs):
            mine = [x.chunk(world)[rank].double() for x in p]
            scale = 1.0 if red == "sum" else 1.0 / world
            errors += check_close(o, sum(mine) * scale, sum(m.abs() for m in mine) * scale, d,
                                  f"functional coalesced RS {red} {s} {d}")
    return errors


def _manager_coalesced(rank, world, seed):
    """Same ops through dist._coalescing_manager, which calls the backend's *_coalesced directly."""
    errors = []
    for async_ops in (True, False):
        cases = [ag_case(seed + 10 * i, n, d, rank, world, offset=i % 4, inplace=(i == 1))
                 for i, (n, d) in enumerate([(7, torch.float32), (3000, torch.bfloat16), (1, torch.uint8)])]
        with dist.distributed_c10d._coalescing_manager(async_ops=async_ops) as cm:
            for c in cases:
                dist.all_gather_into_tensor(c["out"], c["inp"])
        if async_ops:
            cm.wait()
        for c in cases:
            errors += check_case(c, f"coalescing_manager AG async={async_ops} n={c['want'].numel() // world}")
        for op in ["sum", "avg", "premul_float", "premul_tensor"]:
            cases = [rs_case(seed + 20 * i, n, torch.float32, rank, world, op, 2.5, offset=i)
                     for i, n in enumerate([1, 1025, 4096])]
            redop = cases[0]["redop"]
            with dist.distributed_c10d._coalescing_manager(async_ops=async_ops) as cm:
                for c in cases:
                    dist.reduce_scatter_tensor(c["out"], c["inp"], op=redop)
            if async_ops:
                cm.wait()
            for c in cases:
                errors += check_case(c, f"coalescing_manager RS {op} async={async_ops} n={c['out'].numel()}")
    return errors


def _delegated(rank, world, seed):
    """Ops the odc backend hands to its inner gloo backend, interleaved with odc ops."""
    errors = []
    x = [make_input(seed + r, 33, torch.float32) for r in range(world)]
    stacked = torch.stack(x)
    for op, want in [(dist.ReduceOp.SUM, stacked.sum(0)), (dist.ReduceOp.AVG, stacked.mean(0)),
                     (dist.ReduceOp.MAX, stacked.max(0).values)]:
        t = x[rank].clone()
        dist.all_reduce(t, op=op)
        if not torch.allclose(t, want, rtol=1e-5, atol=1e-6):
            errors.append(f"all_reduce {op}: got {t[:4]} want {want[:4]}")
        c = ag_case(seed + 50, 9, torch.float32, rank, world)  # an odc op between delegated ones
        dist.all_gather_into_tensor(c["out"], c["inp"])
        errors += check_case(c, "AG between delegated ops")
    ints = torch.full((5,), rank + 1, dtype=torch.int64)
    dist.all_reduce(ints)
    errors += check_equal(ints, torch.full((5,), world * (world + 1) // 2, dtype=torch.int64), "all_reduce int64")
    b = x[rank].clone()
    dist.broadcast(b, src=world - 1)
    errors += check_equal(b, x[world - 1], "broadcast")
    dist.barrier()
    lst = [torch.full((4,), float("nan")) for _ in range(world)]
    dist.all_gather(lst, x[rank][:4].clone())
    errors += check_equal(torch.stack(lst), stacked[:, :4], "all_gather(list)")
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
    if objs != [{"rank": r, "s": "x" * r} for r in range(world)]:
        errors.append(f"all_gather_object: {objs}")
    bl = [("hello", rank), None] if rank == 1 else [None, None]
    dist.broadcast_object_list(bl, src=1)
    if bl != [("hello", 1), None]:
        errors.append(f"broadcast_object_list: {bl}")
    return errors


def _groups(rank, world, seed):
    """A second full-world odc group and a subgroup coexist with the default one."""
    errors = []
    dup = dist.new_group()
    sub = dist.new_group(ranks=[0, world - 1])
    for i in range(6):  # interleave the groups; > ring slots ops on each
        c = ag_case(seed + 100 * i, 1500 + i, torch.float32, rank, world, offset=i % 3)
        w = dist.all_gather_into_tensor(c["out"], c["inp"], group=dup if i % 2 else None, async_op=True)
        if rank in (0, world - 1):
            srank = 0 if rank == 0 else 1
            s = rs_case(seed + 100 * i + 50, 700, torch.bfloat16, srank, 2, "avg")
            # rs_case built both members' inputs as ranks 0/1 of a 2-rank group
            dist.reduce_scatter_tensor(s["out"], s["inp"], op=s["redop"], group=sub)
            errors += check_case(s, f"subgroup RS iter {i}")
        w.wait()
        errors += check_case(c, f"{'dup' if i % 2 else 'world'} group AG iter {i}")
    return errors


PARTS = {"delegated": _delegated, "groups": _groups, "coalescing_manager": _manager_coalesced,
         "functional_coalesced": _functional_coalesced}


def _parts_worker(rank, world, seed, names):
    return {name: PARTS[name](rank, world, seed) for name in names}


@pytest.mark.parametrize("names", [("delegated", "groups"), ("coalescing_manager", "functional_coalesced")],
                         ids=lambda names: "+".join(names))
def test_misc(names):
    res = run_distributed(_parts_worker, 3, 77, names, env=SMALL_RING, timeout_s=30, deadline_s=180)
    errors = [f"rank {r} {name}: {e}" for r in sorted(res) for name, errs in res[r].items() for e in errs]
    assert not errors, f"{len(errors)} failures:\n" + "\n".join(errors[:40])
