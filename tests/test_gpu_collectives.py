"""GPU tests: odc ("cpu:gloo,cuda:odc") against float64 / bitwise references and, where each
rank has a GPU of its own, against NCCL on the same inputs; stream semantics, device errors,
a stuck peer, ranks that disagree about a collective, the collectives odc serves itself, and
init_process_group(device_id=...). With one GPU the ranks share it (odc runs so; NCCL does
not). Skipped (loudly, see conftest.py) without a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import torch_odc_backend  # noqa: F401  (registers "odc" in this process too)
from dist_utils import GPU_ENV, ranks_share_gpus, run_distributed
from test_collectives import (AG_DTYPES, FLOATS, RS_OPS, ag_case, check_case, check_close,
                              check_equal, rs_case, wait)
from test_errors import PEER, check_peer_failure, expect_error, record_failure, wait_for_survivors

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")

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


@pytest.mark.parametrize("env", [{}, SMALL_GPU_RING, {"ODC_SMALL_OP_BYTES": "0"}, {"ODC_STREAM_MEMOPS": "1"}],
                         ids=["default-env", "chunk256k-slots2", "no-fused-kernel", "stream-memops"])
@pytest.mark.parametrize("world", WORLDS)
def test_matches_reference_and_nccl(world, env):
    """Every case against its float64 / bitwise reference, and against NCCL's result where
    each rank has a GPU of its own."""
    if ranks_share_gpus(world) and world > 2 and env:
        pytest.skip("4 ranks sharing GPUs: the default knobs only (the others run at 2 ranks)")
    res = run_distributed(_compare_worker, world, backend=BACKEND, env={**GPU_ENV, **env},
                          timeout_s=120, deadline_s=500)
    errors = [f"rank {r}: {e}" for r in sorted(res) for e in res[r]]
    assert not errors, f"{len(errors)} mismatches:\n" + "\n".join(errors[:40])


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


def test_async_wait_on_other_stream():
    res = run_distributed(_streams_worker, 2, backend=BACKEND, env=GPU_ENV, timeout_s=60, deadline_s=300)
    errors = [f"rank {r}: {e}" for r in sorted(res) for e in res[r]]
    assert not errors, "\n".join(errors)


def _cross_stream_worker(rank, world):
    """Collectives of one group issued on two streams, the earlier one held back: the ring's
    chunk order must still be the issue order (with 2 slots the ring wraps every 2 chunks)."""
    dev, errors, cases = _device(), [], []
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for i in range(8):
        n = (1 << 20) if i % 3 == 0 else 1000  # copy-engine and fused operations
        with torch.cuda.stream(streams[i % 2]):
            c = ag_case(100 + i, n, torch.float32, rank, world, device=dev)
            if i % 2 == 0:
                torch.cuda._sleep(20_000_000)  # stream 0 lags: op i+1 on stream 1 could overtake
            dist.all_gather_into_tensor(c["out"], c["inp"])
        cases.append(c)
    torch.cuda.synchronize()
    for i, c in enumerate(cases):
        errors += check_case(c, f"AG #{i} on stream {i % 2}")
    return errors


def test_ops_on_two_streams_keep_issue_order():
    res = run_distributed(_cross_stream_worker, 2, backend=BACKEND, env={**GPU_ENV, **SMALL_GPU_RING},
                          timeout_s=60, deadline_s=300)
    errors = [f"rank {r}: {e}" for r in sorted(res) for e in res[r]]
    assert not errors, "\n".join(errors)


def _device_errors_worker(rank, world):
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


def test_device_errors():
    res = run_distributed(_device_errors_worker, 2, backend=BACKEND, env=GPU_ENV, timeout_s=60, deadline_s=300)
    errors = [f"rank {r}: {e}" for r in sorted(res) for e in res[r]]
    assert not errors, "\n".join(errors)


def _stuck_peer_worker(rank, world, mode, tmpdir, n):
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
@pytest.mark.parametrize("n,env", [(1 << 20, {}), (1000, {}), (1 << 20, {"ODC_STREAM_MEMOPS": "1"})],
                         ids=["copy-engines", "fused", "copy-engines-stream-memops"])
def test_stuck_peer_times_out(tmp_path, n, env):
    check_peer_failure(_stuck_peer_worker, 2, "sleep", tmp_path, n, backend=BACKEND, env={**GPU_ENV, **env})


# ----------------------------------------------------------------------------- mismatch
def _mismatch_worker(rank, world):
    import test_mismatch as tm

    return tm.run_cases(rank, world, _device())


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


@pytest.mark.parametrize("world", [2, 3])
def test_own_collectives_on_gpu(world):
    """The collectives odc serves itself, on CUDA tensors: automatically where the ranks share
    a GPU, forced (ODC_SELF_SERVE=1) where each has its own."""
    import test_own_collectives as to

    env = {**GPU_ENV, **to.SMALL_RING} if ranks_share_gpus(world) else {**GPU_ENV, **to.OWN}
    res = run_distributed(_own_worker, world, backend=BACKEND, env=env, deadline_s=400)
    to.assert_results(res, device="cuda")


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
