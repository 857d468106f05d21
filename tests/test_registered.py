"""Zero-copy collectives on registered memory (the backend's allocate_tensor).

An all-gather or reduce-scatter whose input lies in registered memory is read by the peers
where it lies. Its results must be bitwise those of the staged path; ranks on different
paths, or whose buffers lie at different places of their pools, must fail at once, naming
the problem; a full pool hands out ordinary memory; FSDP2 trains the same with it. CPU
(host shared memory) and CUDA (ranks may share a GPU).
"""
from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

import fsdp_models as fm
from dist_utils import GPU_ENV, cuda_case, run_distributed

TIMEOUT_S = 30.0
BF16, F32 = torch.bfloat16, torch.float32


def _device(kind: str) -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def _backend(kind: str) -> str:
    return "cpu:odc" if kind == "cpu" else "cpu:gloo,cuda:odc"


def _env(kind: str) -> dict:
    return {} if kind == "cpu" else dict(GPU_ENV)


def _alloc(dev, n, dtype, group=None):
    b = (group or dist.group.WORLD)._get_backend(dev)
    assert b.supports_tensor_alloc(dev)
    return b.allocate_tensor(n, dtype=dtype, device=dev)


def _stats(dev, group=None):
    return dict((group or dist.group.WORLD)._get_backend(dev).stats())


def _fill(t, seed):
    g = torch.Generator().manual_seed(seed)
    t.copy_(torch.randn(t.numel(), generator=g).to(t.dtype))
    return t


# (op, elements per rank, dtype, reduce op or in place); an all-gather not in place reads its
# registered input zero-copy, but pushes only into a registered output (its output here is
# not: the staged path; only whole buffers qualify); "out": the output registered, the input
# not, which pushes zero-copy and gets take staged; 300 000 bf16 elements per rank = 600 KB:
# the fused kernel on CUDA; 1.5 M fp32 = 6 MB per rank: the copy engines where the fused kernel's
# blocks would each move more than 1 MiB (ranks sharing a GPU), else the fused kernel too.
CASES = [("ag", 1001, BF16, True), ("ag", 1000, F32, False), ("ag", 0, F32, True),
         ("ag", 999, F32, "out"),
         ("rs", 1001, F32, dist.ReduceOp.SUM), ("rs", 1000, BF16, dist.ReduceOp.AVG),
         ("ag", 300_000, BF16, True), ("rs", 1_500_000, F32, dist.ReduceOp.SUM),
         ("ag", 1_500_000, F32, True)]


def _run_case(dev, case, registered, seed):
    op, n, dtype, how = case
    world, rank = dist.get_world_size(), dist.get_rank()
    mk = (lambda k: _alloc(dev, k, dtype)) if registered else (lambda k: torch.empty(k, dtype=dtype, device=dev))
    if op == "ag":
        plain = lambda k: torch.empty(k, dtype=dtype, device=dev)
        out = mk(world * n) if how else plain(world * n)
        inp = out[rank * n:(rank + 1) * n] if how is True else plain(n) if how == "out" else mk(n)
        _fill(inp, seed + rank)
        dist.all_gather_into_tensor(out, inp)
        return out.cpu()
    inp = _fill(mk(world * n), seed + rank)
    out = torch.empty(n, dtype=dtype, device=dev)
    dist.reduce_scatter_tensor(out, inp, op=how)
    return out.cpu()


def _matches_worker(rank, world, kind):
    dev = _device(kind)
    errors = []
    cases = CASES if kind == "cuda" else CASES[:6]
    for rnd in range(3):  # buffers freed and allocated again: the same places, counters in step
        for i, case in enumerate(cases):
            staged = _run_case(dev, case, False, 100 * i + rnd)
            zero_copy = _run_case(dev, case, True, 100 * i + rnd)
            if not torch.equal(staged.view(torch.uint8), zero_copy.view(torch.uint8)):
                errors.append(f"round {rnd} case {case}: registered result differs from the staged one")
    if kind == "cuda":
        torch.cuda.synchronize()
    # zero-copy: reduce-scatters, all-gathers in place, and with gets those from a registered
    # input into ordinary memory (empty ones have no address: staged)
    push = os.environ.get("ODC_AG_PUSH") == "1"
    zero_copy = sum(c[1] > 0 and (c[0] == "rs" or c[3] is True or (c[3] == "out") == push)
                    for c in cases)
    gathers = sum(c[1] > 0 and c[0] == "ag" and c[3] in (True, "out") for c in cases)
    return errors, _stats(dev), (len(cases) * 3, zero_copy * 3, gathers * 3)


# How the zero-copy all-gathers move the shards: gets, pushes (the fused kernel up to 8 MiB per
# copy, the copy engines' conditional graph above), or pushes all on the copy engines.
MODES = {"get": {"ODC_AG_PUSH": "0"}, "push": {"ODC_AG_PUSH": "1"},
         "push-copy-engines": {"ODC_AG_PUSH": "1", "ODC_SMALL_OP_BYTES": "0"}}


@pytest.mark.parametrize("kind,world,mode", [
    ("cpu", 3, "get"), ("cpu", 3, "push"),
    *(cuda_case("cuda", w, m, id=f"cuda-{w}-{m}") for w in (2, 4) for m in MODES)])
def test_registered_matches_staged(kind, world, mode):
    res = run_distributed(_matches_worker, world, kind, backend=_backend(kind),
                          env={**_env(kind), **MODES[mode]}, timeout_s=TIMEOUT_S, deadline_s=240)
    push = mode != "get"
    for rank, (errors, stats, (allocations, calls, gathers)) in res.items():
        assert not errors, f"rank {rank}: " + "\n".join(errors)
        assert stats.get("registered_ops") == calls, (rank, stats)  # every call went zero-copy
        assert stats.get("all_gather_push_ops", 0) == (gathers if push else 0), (rank, stats)
        assert stats.get("registered_allocations") == allocations, (rank, stats)
        assert "registered_fallbacks" not in stats, (rank, stats)
        if mode == "push-copy-engines":  # the graph made once per buffer set, then launched again
            assert stats.get("copy_engine_ops", 0) > 0 and "fused_ops" not in stats, (rank, stats)


def _disagree_worker(rank, world, kind):
    """Each case on a fresh group (a failure leaves its group unusable)."""
    dev = _device(kind)
    out = {}

    def paths(g):  # rank 1 all-gathers in ordinary memory, the others in registered memory
        n = 64
        mine = _alloc(dev, world * n, F32, g)  # every rank sets up its pool
        out = torch.empty(world * n, device=dev) if rank == 1 else mine
        dist.all_gather_into_tensor(out, out[rank * n:(rank + 1) * n], group=g)

    def places(g):  # rank 1 allocates one more buffer first: its input lies elsewhere
        if rank == 1:
            keep = _alloc(dev, 1000, F32, g)  # noqa: F841 (held to the end of the call)
        inp = _alloc(dev, 64 * world, F32, g)
        dist.reduce_scatter_tensor(torch.empty(64, device=dev), inp, group=g)

    def push(g):  # rank 1's group would push its shards (ODC_AG_PUSH=1), the others get theirs
        n = 64
        buf = _alloc(dev, world * n, F32, g)
        dist.all_gather_into_tensor(buf, buf[rank * n:(rank + 1) * n], group=g)

    def growth(g):  # rank 1's first buffer is larger than the least step the pool grows by
        try:
            _alloc(dev, (20_000_000 if kind == "cuda" else 2_000_000) if rank == 1 else 64, F32, g)
        except Exception:
            with pytest.raises(Exception, match="unusable"):  # the pools are apart now
                _alloc(dev, 64, F32, g)
            raise

    for name, call in {"paths": paths, "places": places, "push": push, "growth": growth}.items():
        os.environ["ODC_AG_PUSH"] = "1" if name == "push" and rank == 1 else "0"
        g = dist.new_group(list(range(world)))  # its options are read now
        os.environ.pop("ODC_AG_PUSH")
        t0 = time.monotonic()
        try:
            call(g)
            if kind == "cuda":
                torch.cuda.synchronize()
            dist.all_gather_into_tensor(torch.empty(world, device=dev), torch.ones(1, device=dev), group=g)
            out[name] = None
        except Exception as exc:  # noqa: BLE001
            out[name] = (type(exc).__name__, str(exc), time.monotonic() - t0)
    return out


@pytest.mark.parametrize("kind", ["cpu", cuda_case("cuda", id="cuda")])
def test_disagreeing_ranks_fail_at_once(kind):
    world = 3
    res = run_distributed(_disagree_worker, world, kind, backend=_backend(kind), env=_env(kind),
                          timeout_s=TIMEOUT_S, deadline_s=240)

    def failed_at_once(case, unnoticed, *needles, pattern=None):
        for rank in range(world):
            got = res[rank][case]
            assert got is not None, f"rank {rank}: {unnoticed}"
            kind_, msg, took = got
            assert kind_ == "DistBackendError" and all(n in msg for n in needles), (rank, msg)
            assert pattern is None or re.search(pattern, msg), (rank, msg)
            assert took < TIMEOUT_S / 3, f"rank {rank}: {took:.1f}s (a timeout?)"

    # rank 1's plain tensor: on CUDA the direct form (ODC_ZERO_COPY), whose counters are the
    # registered form's (found by the descriptor check), on CPU the staged one (by the announcement)
    failed_at_once("paths", "registered and plain all-gathers mixed without an error",
                   "issued a different collective", "all_gather (registered memory)",
                   pattern=r"all_gather \(direct\)" if kind == "cuda" else r"called all_gather[,.]")
    # ODC_AG_PUSH set on one rank only: every rank refuses the group when it is set up (its
    # first allocation), naming the knob (tests/test_agreement.py has every such knob)
    for rank in range(world):
        got = res[rank]["push"]
        assert got is not None, f"rank {rank}: pushed and got all-gathers mixed without an error"
        assert got[0] == "ValueError" and "set ODC_AG_PUSH differently" in got[1], (rank, got)
        assert got[2] < TIMEOUT_S / 3, (rank, got)
    # every rank sees that rank 1 grows its pool by more
    failed_at_once("growth", "pools grown by different sizes went unnoticed",
                   "grows its registered memory by", "same order")
    # the ranks reading rank 1's input (and rank 1) see the places differ
    failed_at_once("places", "buffers at different places went unnoticed",
                   "not at the same place", "same order")


def _push_places_worker(rank, world, kind):
    """Every rank pushes (ODC_AG_PUSH=1). A first all-gather succeeds; then rank 1 keeps that
    buffer (a canary) and gathers into another one, elsewhere in its pool, while the others
    gather into the same buffers again: their pushes, through the same graph as the first call,
    would land in the canary. No push may touch it."""
    dev = _device(kind)
    n = 1_500_000  # 6 MB per rank: the copy engines unless the fused kernel is asked for
    # the pool grows at the same allocation everywhere: room for rank 1's second buffer first
    room = _alloc(dev, 2 * world * n + 64, F32)
    del room
    buf = _alloc(dev, world * n, F32)
    _fill(buf[rank * n:(rank + 1) * n], rank)
    dist.all_gather_into_tensor(buf, buf[rank * n:(rank + 1) * n])
    first_ok = torch.equal(buf.cpu(), torch.cat([_fill(torch.empty(n), r) for r in range(world)]))
    canary = None
    if rank == 1:
        canary, buf = buf.fill_(7.0), _alloc(dev, world * n, F32)
    _fill(buf[rank * n:(rank + 1) * n], 10 + rank)
    t0 = time.monotonic()
    try:
        dist.all_gather_into_tensor(buf, buf[rank * n:(rank + 1) * n])
        if kind == "cuda":
            torch.cuda.synchronize()
        dist.all_gather_into_tensor(torch.empty(world, device=dev), torch.ones(1, device=dev))
        got = None
    except Exception as exc:  # noqa: BLE001
        got = (type(exc).__name__, str(exc), time.monotonic() - t0)
    if kind == "cuda":
        torch.cuda.synchronize()
    intact = None if canary is None else bool((canary == 7.0).all())
    return first_ok, got, intact, _stats(dev)


@pytest.mark.parametrize("kind,env,engine", [
    ("cpu", {}, None),
    cuda_case("cuda", {"ODC_SMALL_OP_BYTES": "0"}, "copy_engine_ops", id="cuda-copy-engines"),
    cuda_case("cuda", {"ODC_SMALL_OP_BYTES": "0", "ODC_MATCH_CHECK": "0"}, "copy_engine_ops",
              id="cuda-copy-engines-no-match-check"),
    cuda_case("cuda", {"ODC_SMALL_OP_BYTES": "64M", "ODC_FUSED_BLOCKS": "64"}, "fused_ops", id="cuda-fused"),
])
def test_push_never_writes_where_the_peer_has_no_output(kind, env, engine):
    world = 3
    res = run_distributed(_push_places_worker, world, kind, backend=_backend(kind),
                          env={**_env(kind), **env, "ODC_AG_PUSH": "1"}, timeout_s=TIMEOUT_S,
                          deadline_s=240)
    for rank, (first_ok, got, intact, stats) in res.items():
        assert first_ok, f"rank {rank}: the first pushed all-gather's result is wrong"
        assert got is not None, f"rank {rank}: outputs at different places went unnoticed"
        kind_, msg, took = got
        assert kind_ == "DistBackendError" and "not at the same place" in msg, (rank, msg)
        assert took < TIMEOUT_S / 3, f"rank {rank}: {took:.1f}s (a timeout?)"
        if engine:  # counted once issued (a host transport's wait throws before)
            assert stats.get("all_gather_push_ops") == 2, (rank, stats)
            assert stats.get(engine, 0) >= 2, (rank, stats)
    assert res[1][2] is True, "a push wrote into rank 1's other buffer"


MiB = 1 << 20


def _growing_pool_worker(rank, world, kind, step):
    dev = _device(kind)
    per = lambda nbytes: nbytes // 4 // world  # fp32 elements per rank  # noqa: E731
    bufs = {"a": _alloc(dev, world * per(step // 4), F32),  # the pool's first arena: the least step
            "b": _alloc(dev, world * per(step * 3 // 2), F32),  # no room left: a second arena, its size
            "c": _alloc(dev, world * per(step), F32)}  # past ODC_POOL_BYTES (3 steps): ordinary memory
    bufs["d"] = None
    equal = {}
    for seed, name in enumerate(list(bufs)):
        if name == "d":  # a's arena, whole again once a is freed: no growth
            del bufs["a"]
            bufs["d"] = _alloc(dev, world * per(step), F32)
        out = bufs[name]
        n = out.numel() // world
        _fill(out[rank * n:(rank + 1) * n], 10 * seed + rank)
        dist.all_gather_into_tensor(out, out[rank * n:(rank + 1) * n])
        expected = torch.cat([_fill(torch.empty(n), 10 * seed + r) for r in range(world)])
        equal[name] = torch.equal(out.cpu(), expected)
    return equal, _stats(dev)


@pytest.mark.parametrize("kind,step", [("cpu", 4 * MiB), cuda_case("cuda", 64 * MiB, id="cuda")])
def test_pool_grows_on_every_rank_at_the_same_allocation_up_to_its_limit(kind, step):
    """The pool starts empty and grows by an arena at an allocation that finds no room (a
    step every rank takes there), by at least 4 MiB on CPU and 64 MiB on CUDA; past
    ODC_POOL_BYTES it hands out ordinary memory; freed room is reused before growing again.
    Collectives on blocks of either arena run zero-copy and are right."""
    res = run_distributed(_growing_pool_worker, 2, kind, step, backend=_backend(kind),
                          env=dict(_env(kind), ODC_POOL_BYTES=str(3 * step)), timeout_s=TIMEOUT_S,
                          deadline_s=120)
    for rank, (equal, stats) in res.items():
        assert equal == {"a": True, "b": True, "c": True, "d": True}, (rank, equal)
        assert stats.get("registered_pool_bytes") == step * 5 // 2, (rank, stats)
        assert stats.get("registered_allocations") == 3 and stats.get("registered_fallbacks") == 1, (rank, stats)
        assert stats.get("registered_ops") == 3, (rank, stats)  # a, b, d: c took the staged path


def _growing_alone_worker(rank, world):
    t0, out = time.monotonic(), []
    for step in range(2):
        try:
            if rank == 1 and step == 0:  # only rank 1 needs room
                _alloc(torch.device("cpu"), 2_000_000, F32)
            dist.all_gather_into_tensor(torch.empty(world), torch.ones(1))
            out.append(None)
        except Exception as exc:  # noqa: BLE001
            out.append((str(exc), time.monotonic() - t0))
    return out


def test_a_rank_that_grows_alone_fails_after_the_timeout():
    """Ranks whose allocations differ so that one grows its pool and the others do not:
    that rank fails after the group's timeout naming the rank that did not come, the others
    when their collective times out, and the group is unusable after."""
    res = run_distributed(_growing_alone_worker, 2, backend="cpu:odc", timeout_s=3.0, deadline_s=60)
    (first1, took1), (then1, _) = res[1]
    assert "rank 0 did not take that step within 3000 ms" in first1 and took1 < 15, (first1, took1)
    (first0, took0), (then0, _) = res[0]
    assert "timed out" in first0 and took0 < 15, (first0, took0)
    assert "unusable" in then0 and "unusable" in then1, (then0, then1)


def _fsdp_worker(rank, world, kind, registered):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from torch_odc_backend import registered as reg

    dev = _device(kind)
    torch.use_deterministic_algorithms(True, warn_only=True)  # only the collectives may differ
    mesh = init_device_mesh(kind, (world,))
    with sdpa_kernel(SDPBackend.MATH):
        out = fm.train(mesh, registered=registered == "call", steps=3, device=dev)
    if kind == "cuda":
        torch.cuda.synchronize()
    return fm.to_wire({"run": out, "stats": _stats(dev), "still_watching": bool(reg._WATCH)})


@pytest.mark.parametrize("kind", ["cpu", cuda_case("cuda", id="cuda")])
def test_fsdp2_with_registered_memory_trains_as_without(kind):
    """FSDP2 with torch_odc_backend.use_registered_memory, and with ODC_FSDP_REGISTERED_MEMORY
    and no call: the training of a run without registered memory (bitwise on CPU; on CUDA
    within the FSDP2 tests' tolerance), and its collectives went zero-copy. The staged run leaves the setting empty:
    by default FSDP2 takes no registered memory without the call. On CUDA the run without a
    call uses `auto` (GPUs only), on CPU `1`."""
    env = dict(_env(kind), CUBLAS_WORKSPACE_CONFIG=":4096:8")
    setting = {"staged": {"ODC_FSDP_REGISTERED_MEMORY": ""},  # empty: the default
               "call": {"ODC_FSDP_REGISTERED_MEMORY": "0"},
               "env": {"ODC_FSDP_REGISTERED_MEMORY": "1" if kind == "cpu" else "auto"}}
    runs = {how: run_distributed(_fsdp_worker, 2, kind, how, backend=_backend(kind),
                                 env=dict(env, **setting[how]), timeout_s=TIMEOUT_S, deadline_s=240)
            for how in ("staged", "call", "env")}
    tol = dict(rtol=0, atol=0) if kind == "cpu" else dict(rtol=1e-5, atol=1e-6)
    for rank in range(2):
        assert "registered_ops" not in runs["staged"][rank]["stats"]
        for how in ("call", "env"):
            fm.assert_runs_close(runs[how][rank]["run"], runs["staged"][rank]["run"], **tol,
                                 what=f"rank {rank} registered ({how}) vs staged")
            stats = runs[how][rank]["stats"]
            # FSDP2's own all-gathers and reduce-scatters (every reduce-scatter is one) went
            # zero-copy; DTensor's all-gathers of the results (full_tensor) took the staged path
            assert stats.get("registered_ops", 0) > stats["reduce_scatter_ops"] > 0, (how, stats)
        # the same collectives took the same paths; how many of the direct ones found their
        # input's segment already mapped by every peer depends on timing
        same = [{k: v for k, v in runs[how][rank]["stats"].items() if k != "direct_in_place_ops"}
                for how in ("env", "call")]
        assert same[0] == same[1]
        # the watch for new FSDP2 modules ended at the first optimizer step
        assert not runs["env"][rank]["still_watching"]


def test_use_registered_memory_needs_fsdp_modules():
    import torch_odc_backend

    with pytest.raises(ValueError, match="no FSDP2 module"):
        torch_odc_backend.use_registered_memory(torch.nn.Linear(2, 2))
