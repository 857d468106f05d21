"""Correctness of the "odc" backend's collectives against references every rank computes itself.

Every rank regenerates every rank's input from a seed, so it can compute the exact
expected all-gather output and a float64 reduce-scatter reference locally. Many cases
run back-to-back in one spawned group (spawning is the expensive part on 2 CI cores),
each worker returns a list of human-readable mismatches, and the test asserts it is empty.

The helpers (make_input, poisoned, ag_case, rs_case, check_*) serve the CPU tests and the
CUDA ones (the second half of this file: GPU-only behaviours, against NCCL too).
"""
from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import torch_odc_backend  # noqa: F401  (registers "odc" in this process too)
from dist_utils import GPU_ENV, NVSHMEM_SUITE, gpu_test, ranks_share_gpus, run_distributed

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
    [(2, SMALL_RING), (3, {"ODC_CHUNK_BYTES": "8192", "ODC_RING_SLOTS": "3"}), (4, SMALL_RING), (2, {}),
     (3, {**SMALL_RING, "ODC_STAGED_AG_PUSH": "1"})],
    ids=["w2-chunk4k-slots2", "w3-chunk8k-slots3", "w4-chunk4k-slots2", "w2-default-env",
         "w3-chunk4k-slots2-staged-ag-push"],
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

# ============================================================================= CUDA
# odc ("cpu:gloo,cuda:odc") against float64 / bitwise references and, where each rank has a
# GPU of its own, against NCCL on the same inputs; stream semantics, device errors, a stuck
# peer, ranks that disagree about a collective, the collectives odc serves itself, and
# init_process_group(device_id=...). With one GPU the ranks share it (odc runs so; NCCL does
# not). GPU-only (marker gpu; skipped, loudly, without a GPU: see conftest.py). The helpers
# of test_errors are imported where they are used: test_errors imports this module.

BACKEND = "cpu:gloo,cuda:odc"
# NVLink multicast must stay off on shared hosts.
SMALL_GPU_RING = {"ODC_CHUNK_BYTES": str(256 << 10), "ODC_RING_SLOTS": "2"}
BIG = 64 << 20  # bytes: all-gather output / reduce-scatter input of the largest case
# NCCL (through torch 2.11) returns near-zero garbage for bf16 PREMUL_SUM: torch hands NCCL
# an fp32 factor for bf16 data (ProcessGroupNCCL's unpackPreMulSum<float, ncclBfloat16>).
# Those cases compare odc with the float64 reference only (measured on 2 x H200, 2026-11-22).
NCCL_BROKEN = {(torch.bfloat16, "premul_float"), (torch.bfloat16, "premul_tensor")}
WORLDS = [2, 4]  # ranks; they share GPUs where there are fewer


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def run_checked(worker, world, env=None, timeout_s=60, deadline_s=300):
    """Run ``worker`` (returns a list of problems) on ``world`` ranks of BACKEND; fail with them."""
    res = run_distributed(worker, world, backend=BACKEND, env={**GPU_ENV, **(env or {})},
                          timeout_s=timeout_s, deadline_s=deadline_s)
    errors = [f"rank {r}: {e}" for r in sorted(res) for e in res[r]]
    assert not errors, f"{len(errors)} problems:\n" + "\n".join(errors[:40])


def _sizes(dtype, world):
    """Per-rank element counts from 1 element up to a 64 MiB collective."""
    big = BIG // (torch.empty(0, dtype=dtype).element_size() * world)
    return [1, 7, 1001, 65_537, (1 << 20) + 3, big]


def _cases(world):
    cases = [dict(kind="ag", dtype=d, n=n) for d in AG_DTYPES for n in _sizes(d, world)]
    cases += [dict(kind="rs", dtype=d, op=op, n=n) for d in FLOATS for op in RS_OPS for n in _sizes(d, world)]
    for i, c in enumerate(cases):
        c.update(seed=1000 * i, async_op=i % 2 == 1, wait="future" if i % 4 == 3 else "work",
                 offset=i % 4, inplace=c["kind"] == "ag" and i % 3 == 0, factor=[2.5, -0.75, 1 / 3][i % 3])
    return cases


def _compare_worker(rank, world):
    dev, errors = _device(), []
    nccl = None if ranks_share_gpus(world) else dist.new_group(backend="nccl")
    for c in _cases(world):
        what = " ".join(f"{k}={c[k]}" for k in ("kind", "dtype", "n", "op", "async_op", "inplace") if k in c)
        if c["kind"] == "ag":
            a, b = (ag_case(c["seed"], c["n"], c["dtype"], rank, world, c["offset"], c["inplace"], dev)
                    for _ in range(2))
            work = dist.all_gather_into_tensor(a["out"], a["inp"], async_op=c["async_op"])
            if nccl is None:
                b = None
            else:
                dist.all_gather_into_tensor(b["out"], b["inp"], group=nccl)
        else:
            a, b = (rs_case(c["seed"], c["n"], c["dtype"], rank, world, c["op"], c["factor"], c["offset"], dev)
                    for _ in range(2))
            work = dist.reduce_scatter_tensor(a["out"], a["inp"], op=a["redop"], async_op=c["async_op"])
            if nccl is None or (c["dtype"], c["op"]) in NCCL_BROKEN:
                b = None
            else:
                dist.reduce_scatter_tensor(b["out"], b["inp"], op=b["redop"], group=nccl)
        if work is not None:
            wait(work, c["wait"])  # no synchronize: the checks below run on the current stream
        errors += check_case(a, f"odc {what}")
        if b is None:
            continue
        if c["kind"] == "rs":
            # NCCL accumulates in the dtype: up to world - 1 roundings where odc rounds once
            b["mag"] = b["mag"] * (world - 1)
        errors += check_case(b, f"nccl (sanity) {what}")
        if c["kind"] == "ag":
            errors += check_equal(a["out"], b["out"], f"odc vs nccl {what}")
        else:
            # both sides round: allow each its budget
            errors += check_close(a["out"], b["out"].double(), world * a["mag"], c["dtype"], f"odc vs nccl {what}")
        del a, b
    return errors


@gpu_test()
@pytest.mark.parametrize("env", [{}, SMALL_GPU_RING, {"ODC_SMALL_OP_BYTES": "0"}, {"ODC_STREAM_MEMOPS": "1"},
                                 {"ODC_STAGED_AG_PUSH": "1"}],
                         ids=["default-env", "chunk256k-slots2", "no-fused-kernel", "stream-memops",
                              "staged-ag-push"])
@pytest.mark.parametrize("world", WORLDS)
def test_matches_reference_and_nccl(world, env):
    """Every case against its float64 / bitwise reference, and against NCCL's result where
    each rank has a GPU of its own."""
    if ranks_share_gpus(world) and world > 2 and env:
        pytest.skip("4 ranks sharing GPUs: the default knobs only (the others run at 2 ranks)")
    run_checked(_compare_worker, world, env, timeout_s=120, deadline_s=500)


def _streams_worker(rank, world):
    """The op must wait for the input written on the current stream, and work.wait() issued on
    another stream must order that stream after the op."""
    dev, errors = _device(), []
    side = torch.cuda.Stream()
    for i, kind in enumerate(["ag", "rs", "ag", "rs"]):
        c = (ag_case(i, (1 << 20) + 1, torch.bfloat16, rank, world, device=dev) if kind == "ag" else
             rs_case(i, (1 << 20) + 1, torch.float32, rank, world, "avg", device=dev))
        ready = c["inp"].clone()
        c["inp"].fill_(float("nan"))
        torch.cuda._sleep(50_000_000)  # the real input lands late on the current stream
        c["inp"].copy_(ready)
        if kind == "ag":
            work = dist.all_gather_into_tensor(c["out"], c["inp"], async_op=True)
        else:
            work = dist.reduce_scatter_tensor(c["out"], c["inp"], op=c["redop"], async_op=True)
        with torch.cuda.stream(side):
            wait(work, "work" if i < 2 else "future")
            seen = c["out"].clone()  # consumed on the side stream
        torch.cuda.current_stream().wait_stream(side)
        errors += check_case({**c, "out": seen}, f"{kind} consumed on another stream")
    return errors


@gpu_test()
def test_async_wait_on_other_stream():
    run_checked(_streams_worker, 2)


def _on_two_streams(n_ops, issue, what):
    """issue(i) enqueues op i on stream i % 2 and returns its case; every case is checked
    (labelled what(i)) once the device is idle."""
    streams, cases, errors = [torch.cuda.Stream(), torch.cuda.Stream()], [], []
    for i in range(n_ops):
        with torch.cuda.stream(streams[i % 2]):
            cases.append(issue(i))
    torch.cuda.synchronize()
    for i, c in enumerate(cases):
        errors += check_case(c, what(i))
    return errors


def _cross_stream_worker(rank, world):
    """Collectives of one group issued on two streams, the earlier one held back: the ring's
    chunk order must still be the issue order (with 2 slots the ring wraps every 2 chunks)."""
    dev = _device()

    def issue(i):
        n = (1 << 20) if i % 3 == 0 else 1000  # copy-engine and fused operations
        c = ag_case(100 + i, n, torch.float32, rank, world, device=dev)
        if i % 2 == 0:
            torch.cuda._sleep(20_000_000)  # stream 0 lags: op i+1 on stream 1 could overtake
        dist.all_gather_into_tensor(c["out"], c["inp"])
        return c
    return _on_two_streams(8, issue, lambda i: f"AG #{i} on stream {i % 2}")


@gpu_test()
def test_ops_on_two_streams_keep_issue_order():
    run_checked(_cross_stream_worker, 2, SMALL_GPU_RING)


def _one_queue_worker(rank, world):
    """Copy-engine all-gathers and reduce-scatters on two streams, every stream of the process
    on one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1): the queue runs the lanes' steps in
    issue order, so a signal held back behind a wait would deadlock the ranks."""
    dev = _device()

    def issue(i):
        if i % 2 == 0:
            c = ag_case(200 + i, 1 << 20, torch.bfloat16, rank, world, device=dev)
            dist.all_gather_into_tensor(c["out"], c["inp"])
        else:
            c = rs_case(200 + i, 1 << 20, torch.float32, rank, world, "sum", device=dev)
            dist.reduce_scatter_tensor(c["out"], c["inp"], op=c["redop"])
        return c
    return _on_two_streams(6, issue, lambda i: f"op #{i} with one hardware queue")


# Ranks sharing one GPU, each process's streams on one hardware queue: the worst aliasing of
# streams onto queues (under MPS a process gets few queues; 4 ranks there used to hang).
@gpu_test()
@pytest.mark.parametrize("world", [2, 4])
def test_one_hardware_queue_per_process(world):
    env = {**SMALL_GPU_RING, "CUDA_DEVICE_MAX_CONNECTIONS": "1", "ODC_SMALL_OP_BYTES": "0"}
    run_checked(_one_queue_worker, world, env, timeout_s=30, deadline_s=240)


def _engine_worker(rank, world):
    """Which engine serves each size, as the group's stats report it, and its results."""
    from torch_odc_backend import backend_stats

    dev, errors = _device(), []
    # (elements per rank, fp32): the fused kernel with one block per lane, with several per lane
    # (two lanes move data: each gets up to half of ODC_FUSED_BLOCKS, 32), then the copy engines.
    for n, engine, blocks in [(1024, "fused", (2, 2)), (1 << 18, "fused", (4, 32)), (1 << 22, "copy_engine", None)]:
        c = ag_case(n, n, torch.float32, rank, world, device=dev)
        before = backend_stats(device="cuda")
        dist.all_gather_into_tensor(c["out"], c["inp"])
        after = backend_stats(device="cuda")
        errors += check_case(c, f"all_gather of {n} floats per rank")
        got = {k: after.get(k, 0) - before.get(k, 0) for k in ("fused_ops", "copy_engine_ops", "fused_blocks")}
        if got[f"{engine}_ops"] != 1 or sum(got[k] for k in ("fused_ops", "copy_engine_ops")) != 1:
            errors.append(f"{n} floats per rank: expected the {engine} engine, stats changed by {got}")
        if blocks is not None and not blocks[0] <= got["fused_blocks"] <= blocks[1]:
            errors.append(f"{n} floats per rank: expected {blocks[0]}-{blocks[1]} fused blocks, got {got['fused_blocks']}")
    # In place (the output is this rank's part of the input), odd sizes, fused on several blocks:
    # every element is summed once, however the lane's blocks slice it.
    for n in (7, 40_001, (1 << 17) + 5):
        xs = [make_input(50 + r, world * n, torch.float32, dev) for r in range(world)]
        want = sum(x[rank * n:(rank + 1) * n].double() for x in xs)
        inp = xs[rank].clone()
        out = inp[rank * n:(rank + 1) * n]
        dist.reduce_scatter_tensor(out, inp)
        errors += check_close(out, want, sum(x[rank * n:(rank + 1) * n].abs().double() for x in xs),
                              torch.float32, f"in-place reduce_scatter of {n} floats per rank")
    return errors


@gpu_test()
def test_engine_per_size_in_stats():
    run_checked(_engine_worker, 2, deadline_s=200)


def _outlive_group_worker(rank, world):
    """Tensors of async collectives freed after the group is gone: the caching allocator
    records an event on every stream a tensor was recorded on (the group's async stream) when
    it frees it, so that stream must outlive the group."""
    import gc

    dev, errors, n = _device(), [], 4096
    a = ag_case(7, n, torch.float32, rank, world, device=dev)
    r = rs_case(8, n, torch.float32, rank, world, device=dev)
    dist.all_gather_into_tensor(a["out"], a["inp"], async_op=True).wait()
    dist.reduce_scatter_tensor(r["out"], r["inp"], async_op=True).wait()
    errors += check_case(a, "async all_gather") + check_case(r, "async reduce_scatter")
    torch.cuda.synchronize()
    dist.destroy_process_group()
    gc.collect()  # the group's backend goes
    del a, r  # their memory returns to the caching allocator now
    gc.collect()
    torch.empty(1 << 20, device=dev).fill_(1.0)  # and is reused
    torch.cuda.synchronize()
    return errors


@gpu_test()
def test_async_outputs_outlive_the_group():
    run_checked(_outlive_group_worker, 2, deadline_s=120)


def _device_errors_worker(rank, world):
    from test_errors import expect_error

    dev, errors, n = _device(), [], 8
    e = torch.empty
    cuda_only, cpu_only = dist.new_group(backend="cuda:odc"), dist.new_group(backend="cpu:odc")
    other = torch.device("cuda", (dev.index + 1) % torch.cuda.device_count())
    cases = [
        ("AG input on CPU", lambda a: dist.all_gather_into_tensor(e(world * n, device=dev), e(n), async_op=a)),
        ("AG output on CPU", lambda a: dist.all_gather_into_tensor(e(world * n), e(n, device=dev), async_op=a)),
        ("RS input on CPU", lambda a: dist.reduce_scatter_tensor(e(n, device=dev), e(world * n), async_op=a)),
        ("CPU tensors into a cuda-only odc group",
         lambda a: dist.all_gather_into_tensor(e(world * n), e(n), group=cuda_only, async_op=a)),
        ("CUDA tensors into a cpu-only odc group",
         lambda a: dist.all_gather_into_tensor(e(world * n, device=dev), e(n, device=dev), group=cpu_only, async_op=a)),
    ]
    if other != dev:  # needs a second GPU
        cases.append(("tensors on another rank's GPU",
                      lambda a: dist.all_gather_into_tensor(e(world * n, device=other), e(n, device=other),
                                                            async_op=a)))
    c = ag_case(0, 100, torch.float32, rank, world, device=dev)  # set up the cuda channel first
    dist.all_gather_into_tensor(c["out"], c["inp"])
    errors += check_case(c, "AG before errors")
    for i, (name, fn) in enumerate(cases):
        for async_op in (False, True):
            problem = expect_error(fn, async_op, "device")
            if problem:
                errors.append(f"{name} async_op={async_op}: {problem}")
            c = ag_case(10 * i + async_op, 4097, torch.bfloat16, rank, world, offset=i % 4, device=dev)
            dist.all_gather_into_tensor(c["out"], c["inp"])
            errors += check_case(c, f"AG after {name} async_op={async_op}")
    return errors


@gpu_test()
def test_device_errors():
    run_checked(_device_errors_worker, 2)


def _stuck_peer_worker(rank, world, mode, tmpdir, n):
    from test_errors import PEER, record_failure, wait_for_survivors

    dev = _device()
    c = ag_case(1, n, torch.float32, rank, world, device=dev)
    dist.all_gather_into_tensor(c["out"], c["inp"])
    torch.cuda.synchronize()
    if rank == PEER:  # skips the next collectives
        wait_for_survivors(tmpdir, world)
        return None

    def body():
        # The failure may surface at the call, at synchronize(), or at the next odc call.
        dist.all_gather_into_tensor(c["out"], c["inp"])
        torch.cuda.synchronize()
        dist.all_gather_into_tensor(c["out"], c["inp"])
        torch.cuda.synchronize()
    record_failure(tmpdir, rank, body)


# 4 MiB per rank runs on the copy engines (waits in spin kernels, or stream memory operations
# released by the watchdog), 1000 elements in the fused small-op kernel.
@gpu_test()
@pytest.mark.parametrize("n,env", [(1 << 20, {}), (1000, {}), (1 << 20, {"ODC_STREAM_MEMOPS": "1"})],
                         ids=["copy-engines", "fused", "copy-engines-stream-memops"])
def test_stuck_peer_times_out(tmp_path, n, env):
    from test_errors import check_peer_failure

    check_peer_failure(_stuck_peer_worker, 2, "sleep", tmp_path, n, backend=BACKEND, env={**GPU_ENV, **env})


# ----------------------------------------------------------------------------- mismatch
def _mismatch_worker(rank, world):
    import test_mismatch as tm

    return tm.run_cases(rank, world, _device())


@gpu_test()
@pytest.mark.parametrize("env", [{}, {**SMALL_GPU_RING, "ODC_SMALL_OP_BYTES": "0"}, {"ODC_STREAM_MEMOPS": "1"}],
                         ids=["fused-kernel", "copy-engines", "stream-memops"])
def test_mismatch_is_reported_on_every_rank(env):
    """The CPU mismatch cases (tests/test_mismatch.py) on GPUs: found by the kernels."""
    import test_mismatch as tm

    res = run_distributed(_mismatch_worker, tm.WORLD, backend=BACKEND, env={**GPU_ENV, **env},
                          timeout_s=tm.TIMEOUT_S, deadline_s=300)
    for case in tm.CASES:
        tm.assert_reported(res, case)
    tm.assert_different_collectives_reported(res)
    tm.assert_others_fine(res)


# ----------------------------------------------------------------------------- own collectives
def _own_worker(rank, world):
    import test_own_collectives as to

    return to.run_all(rank, world, _device())


@gpu_test()
@pytest.mark.parametrize("world", [2, 3])
def test_own_collectives_on_gpu(world):
    """The collectives odc serves itself, on CUDA tensors: automatically where the ranks share
    a GPU, forced (ODC_SELF_SERVE=1) where each has its own."""
    import test_own_collectives as to

    env = {**GPU_ENV, **to.SMALL_RING} if ranks_share_gpus(world) else {**GPU_ENV, **to.OWN}
    res = run_distributed(_own_worker, world, backend=BACKEND, env=env, deadline_s=400)
    to.assert_results(res, device="cuda")


def _small_collectives_worker(rank, world):
    dev = _device()
    stats = lambda: dict(dist.group.WORLD._get_backend(dev).stats())
    # served by odc: up to 1 MiB a rank
    t = torch.tensor([float(rank + 1)], device=dev)
    dist.all_reduce(t)  # a scalar (a gradient norm)
    b = torch.full((1024,), float(rank), device=dev)
    dist.broadcast(b, 1)  # 4 KiB
    dist.barrier(device_ids=[dev.index])
    edge = torch.ones(1 << 18, device=dev)  # exactly 1 MiB
    dist.all_reduce(edge)
    cl = (torch.ones(2, 8, 4, 4, device=dev) * (rank + 1)).to(memory_format=torch.channels_last)
    dist.all_reduce(cl)  # dense, not contiguous: as NCCL, its memory's elements
    rs = torch.empty(256, device=dev)
    dist.reduce_scatter(rs, [torch.full((256,), float(r + rank), device=dev) for r in range(world)])
    small = stats()
    # to NCCL: past 1 MiB; an uneven all-gather whose mean piece is; a dtype odc does not reduce
    big = torch.ones((1 << 18) + 4, device=dev)
    dist.all_reduce(big)
    sizes = [1 << 16, 1 << 19]  # 256 KiB and 2 MiB: rank 0's alone would be small
    pieces = [torch.empty(n, device=dev) for n in sizes]
    dist.all_gather(pieces, torch.full((sizes[rank],), float(rank), device=dev))
    z = torch.full((4,), 1 + 1j, device=dev, dtype=torch.complex64)
    dist.all_reduce(z)
    after = stats()
    # under CUDA graph capture: NCCL's (its group ran above)
    c = torch.ones(4, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(c)
    graph.replay()
    torch.cuda.synchronize()
    captured = stats()
    # a group whose inner NCCL group never ran: a captured collective is refused, naming the way out
    fresh = dist.new_group(list(range(world)))
    f = torch.ones(4, device=dev)
    dist.all_reduce(f, group=fresh)  # small: odc's
    refused = ""
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            dist.all_reduce(f, group=fresh)
    except RuntimeError as e:
        refused = str(e)
    torch.cuda.synchronize()
    values = [t.item(), b[0].item(), edge[0].item(), cl.sum().item(), rs[0].item(), big[0].item(),
              pieces[0].sum().item(), pieces[1].mean().item(), z[0].item(), c[0].item(), f[0].item()]
    return {"values": values, "small": small, "after": after, "captured": captured,
            "channels_last": cl.is_contiguous(memory_format=torch.channels_last), "refused": refused}


@gpu_test(2)
def test_small_collectives_are_served_by_odc():
    """ODC_SELF_SERVE=auto, a GPU per rank: odc serves collectives of up to 1 MiB a rank (and
    barriers) itself, so no NCCL group is made for them; larger ones, dtypes odc does not reduce
    and captured ones go to NCCL; an uneven all-gather is judged by its mean piece, alike on
    every rank; a captured collective on a group whose NCCL group never ran is refused."""
    if NVSHMEM_SUITE:
        pytest.skip("peers over NVSHMEM: these collectives are NCCL's")
    world = 2
    env = {**GPU_ENV, "ODC_TRANSPORT": "ipc", "ODC_SELF_SERVE": "auto"}  # CUDA IPC: every rank's own GPU
    res = run_distributed(_small_collectives_worker, world, backend=BACKEND, env=env, deadline_s=120)
    for rank, r in res.items():
        rs = float(2 * rank + 1)  # sum over ranks q of (rank + q)
        assert r["values"] == [3.0, 1.0, 2.0, 3.0 * 256, rs, 2.0, 0.0, 1.0, 2 + 2j, 2.0, 2.0], (rank, r)
        assert r["channels_last"], rank
        small = r["small"]
        got = [small.get(k) for k in ("own_all_reduce_ops", "own_broadcast_ops", "own_barrier_ops",
                                      "own_reduce_scatter_ops")]
        assert got == [3, 1, 1, 1], (rank, small)
        assert "delegated_ops" not in small, (rank, small)
        assert r["after"].get("delegated_ops") == 3, (rank, r["after"])  # big, uneven, complex
        assert r["captured"].get("delegated_ops") == 4, (rank, r["captured"])
        assert "ODC_SELF_SERVE" in r["refused"] and "capture" in r["refused"], (rank, r["refused"])


# ----------------------------------------------------------------------------- device_id
def _device_id_worker(rank, world):
    """With device_id, DeviceMesh splits its groups from the default one (odc's split)."""
    from torch.distributed.device_mesh import init_device_mesh

    from torch_odc_backend import OdcBackend

    dev = _device()
    assert dist.group.WORLD.bound_device_id == dev, dist.group.WORLD.bound_device_id
    out = {}
    mesh = init_device_mesh("cuda", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    for dim in ("replicate", "shard"):
        g = mesh.get_group(dim)
        b = g._get_backend(dev)
        y = torch.empty(g.size(), device=dev)
        dist.all_gather_into_tensor(y, torch.tensor([float(rank)], device=dev), group=g)
        t = torch.tensor([float(rank)], device=dev)
        dist.all_reduce(t, group=g)
        out[dim] = (isinstance(b, OdcBackend), b.global_ranks(), y.tolist(), t.item())
    pair = dist.new_group([0, 1])  # ranks outside it: perform_nocolor_split
    if rank in (0, 1):
        y = torch.empty(2, device=dev)
        dist.all_gather_into_tensor(y, torch.tensor([float(rank)], device=dev), group=pair)
        out["pair"] = y.tolist()
    return out


@gpu_test()
def test_device_id_splits_groups(tmp_path):
    world = 4
    res = run_distributed(_device_id_worker, world, backend=BACKEND, env=GPU_ENV, deadline_s=300,
                          device_id=True)
    for rank, out in res.items():
        row, col = divmod(rank, 2)
        shard, repl = [2 * row, 2 * row + 1], [col, col + 2]
        assert out["shard"] == (True, shard, [float(r) for r in shard], float(sum(shard))), (rank, out)
        assert out["replicate"] == (True, repl, [float(r) for r in repl], float(sum(repl))), (rank, out)
        if rank in (0, 1):
            assert out["pair"] == [0.0, 1.0]
