"""NVSHMEM runtime and transport: a build without it says how to get it; with >= 2 GPUs and
an ODC_WITH_NVSHMEM=1 build, initialisation over the default group, a checked put-with-signal
between neighbours, collectives and decoupled mode with peers routed over NVSHMEM (skipped,
loudly, otherwise).

ODC_TEST_NVSHMEM_SHARED_GPU=1 lets the routed collectives run with ranks sharing GPUs where
the machine has fewer (NVSHMEM's several-PEs-per-GPU mode). ODC_TEST_NVSHMEM_REMOTE=1 (implies
it) says the environment gives NVSHMEM a remote transport between the ranks (e.g.
NVSHMEM_DISABLE_P2P=1 NVSHMEM_REMOTE_TRANSPORT=ucx): they must then see network peers."""
import os

import pytest
import torch

from torch_odc_backend import config
from torch_odc_backend import nvshmem as odc_nvshmem
from dist_utils import GPU_ENV, run_distributed



def test_build_without_nvshmem_says_how_to_enable_it():
    if odc_nvshmem.available():
        pytest.skip("this build has the NVSHMEM runtime")
    for call in (odc_nvshmem.init, odc_nvshmem.status, lambda: odc_nvshmem.ring_selftest(8)):
        with pytest.raises(RuntimeError, match="ODC_WITH_NVSHMEM=1"):
            call()


def _worker(rank, world):
    torch.cuda.set_device(rank)
    fresh = odc_nvshmem.init(slab_bytes=256 << 20)
    again = odc_nvshmem.init()  # once per process: the second call joins
    st = odc_nvshmem.status()
    assert st["slab_bytes"] == 256 << 20 and st["slab_used"] == 0
    tests = {n: odc_nvshmem.ring_selftest(n) for n in (8, 4096 + 3, 8 << 20)}
    return fresh, again, st, tests


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not odc_nvshmem.available(),
                    reason="needs >= 2 CUDA GPUs and an ODC_WITH_NVSHMEM=1 build")
def test_gpu_nvshmem_init_once_and_put_with_signal():
    results = run_distributed(_worker, 2, backend="cpu:gloo,cuda:nccl", env=GPU_ENV, deadline_s=240)
    for rank, (fresh, again, st, tests) in results.items():
        assert fresh is True and again is False, rank
        assert st["init_status"] >= 2 and st["my_pe"] == rank and st["n_pes"] == 2
        for n, r in tests.items():
            assert r["mismatched_bytes"] == 0, (rank, n, r)
            assert r["next_pe_is_p2p"], (rank, n, r)  # GPUs of one host


def test_odc_transport_knob(monkeypatch):
    from torch_odc_backend import config

    for raw, kind in (("", "AUTO"), ("auto", "AUTO"), ("NVSHMEM", "NVSHMEM"), ("ipc", "CUDA_IPC")):
        monkeypatch.setenv("ODC_TRANSPORT", raw)
        assert config.knobs().transport == getattr(config.TransportKind, kind)
    monkeypatch.setenv("ODC_TRANSPORT", "ib")
    with pytest.raises(ValueError, match="ODC_TRANSPORT='ib'"):
        config.knobs()
    monkeypatch.setenv("ODC_TRANSPORT", "auto")
    monkeypatch.delenv("ODC_HOST_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # a nested launch's leftover: not a host split
    assert config.knobs().host_size == 0
    monkeypatch.setenv("ODC_HOST_SIZE", "2")
    assert config.knobs().host_size == 2
    monkeypatch.setenv("ODC_HOST_SIZE", "0")
    with pytest.raises(ValueError, match="ODC_HOST_SIZE"):
        config.knobs()


def test_nvshmem_stage_knob_and_routing(monkeypatch):
    """ODC_NVSHMEM_STAGE parses; routes_some_peer says which groups reach a peer over NVSHMEM
    (where odc.decouple then picks accumulate="local" by itself)."""
    from torch_odc_backend import config

    for raw, always in (("", False), ("auto", False), ("ALWAYS", True)):
        monkeypatch.setenv("ODC_NVSHMEM_STAGE", raw)
        assert config.knobs().nvshmem_stage_always is always
    monkeypatch.setenv("ODC_NVSHMEM_STAGE", "never")
    with pytest.raises(ValueError, match="ODC_NVSHMEM_STAGE='never'"):
        config.knobs()
    monkeypatch.delenv("ODC_NVSHMEM_STAGE")
    monkeypatch.delenv("ODC_TRANSPORT", raising=False)
    monkeypatch.delenv("ODC_HOST_SIZE", raising=False)
    assert not odc_nvshmem.routes_some_peer([0, 1, 2, 3])  # one host
    monkeypatch.setenv("ODC_HOST_SIZE", "2")
    # other hosts over NVSHMEM where built; else no routing (NCCL serves groups across hosts)
    built = odc_nvshmem.available()
    assert odc_nvshmem.routes_some_peer([0, 1, 2, 3]) is built and odc_nvshmem.routes_some_peer([1, 2]) is built
    assert config.knobs().splits_hosts(1, 2) and not config.knobs().splits_hosts(2, 3)
    assert not odc_nvshmem.routes_some_peer([2, 3])  # one "host" of the split
    monkeypatch.setenv("ODC_TRANSPORT", "ipc")
    assert not odc_nvshmem.routes_some_peer([0, 1, 2, 3])
    monkeypatch.setenv("ODC_TRANSPORT", "nvshmem")
    assert odc_nvshmem.routes_some_peer([2, 3]) and not odc_nvshmem.routes_some_peer([3])


def test_default_group_creation_brings_nvshmem_up(tmp_path, monkeypatch):
    """The default group's odc backend calls the NVSHMEM hook (with its store, rank, world and
    options) as it is created; later groups do not (their creation is not world-collective)."""
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(odc_nvshmem, "init_from_backend",
                        lambda store, rank, world, options: calls.append(
                            (store.set("k", b"v"), rank, world, options.ring_slots)))
    monkeypatch.setenv("ODC_RING_SLOTS", "3")  # the group's options carry it to the hook
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("cpu:odc", store=store, rank=0, world_size=1)
    try:
        assert calls == [(None, 0, 1, 3)]
        dist.new_group([0])
        dist.barrier()
        assert len(calls) == 1
    finally:
        dist.destroy_process_group()
    if not odc_nvshmem.available():  # the real hook is a no-op in builds without NVSHMEM
        monkeypatch.undo()
        monkeypatch.setenv("ODC_TRANSPORT", "nvshmem")
        assert odc_nvshmem.init_from_backend(None, 0, 2, config.knobs()) is False


def _remote_env() -> bool:
    return os.environ.get("ODC_TEST_NVSHMEM_REMOTE") == "1"


def _collectives_worker(rank, world):
    import torch.distributed as dist

    import fsdp_models as fm
    from test_decoupled import run_configs
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(rank % torch.cuda.device_count())
    up = odc_nvshmem.status()  # no init() call: the default group's backend brought it up
    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    shard = torch.randn(3 << 20, device="cuda", generator=g, dtype=torch.bfloat16)
    out = torch.empty(world * shard.numel(), device="cuda", dtype=shard.dtype)
    dist.all_gather_into_tensor(out, shard)
    rows = torch.randn(world * 4096, device="cuda", generator=g)
    red = torch.empty(4096, device="cuda")
    dist.reduce_scatter_tensor(red, rows)
    every, rows_of = [], []
    for r in range(world):  # every rank's draws, in the same order
        gr = torch.Generator(device="cuda").manual_seed(100 + r)
        every.append(torch.randn(3 << 20, device="cuda", generator=gr, dtype=torch.bfloat16))
        rows_of.append(torch.randn(world * 4096, device="cuda", generator=gr))
    expect = sum(x.view(world, -1)[rank] for x in rows_of)
    sub = _cross_host_subgroup_check(rank, world) if world == 4 else None
    st = odc_nvshmem.status()  # windows from the slab; routed gets / puts / signals issued
    used = (st["slab_used"], st["routed_copies"], st["routed_signals"], st["staged_copies"],
            st["network_peers"])
    # owner-side accumulation cannot reach routed peers: refused before anything runs, and
    # chosen away from when decouple is not told
    import torch_odc_backend as odc

    model, opt = fm.build(init_device_mesh("cuda", (world,)), seed=5, device="cuda")
    try:
        odc.decouple(model, opt, accumulate="owner")
        refused = None
    except ValueError as e:
        refused = str(e)
    model, opt = fm.build(init_device_mesh("cuda", (world,)), seed=5, device="cuda")
    chosen = odc.decouple(model, opt).accumulate
    # FSDP2 in decoupled mode over the same transport (accumulate="local": NVSHMEM has no
    # float atomics for the owner-side put-accumulate)
    decoupled = fm.to_wire(run_configs({"bf16_local": dict(mesh=(world,), bf16=True, accumulate="local")},
                                       "cuda")[0])
    return (bool(torch.equal(out, torch.cat(every))), float((red - expect).abs().max()), used,
            decoupled, (refused, chosen), sub,
            (up["init_status"], up["slab_bytes"], odc_nvshmem.default_slab_bytes(world)))


def _cross_host_subgroup_check(rank, world):
    """Groups [0, 2] and [1, 3] span both "hosts" of ODC_HOST_SIZE=2: group rank 1 of [1, 3]
    is PE 3, so a wrong group-rank-to-PE mapping moves the wrong rank's data."""
    import torch.distributed as dist

    groups = {r: dist.new_group([r % 2, r % 2 + 2]) for r in (0, 1)}  # every rank creates both
    group, members = groups[rank % 2], [rank % 2, rank % 2 + 2]
    mine = torch.full((1 << 20,), float(rank + 1), device="cuda")
    out = torch.empty(2 << 20, device="cuda")
    dist.all_gather_into_tensor(out, mine, group=group)
    rows = torch.arange(2 << 10, device="cuda", dtype=torch.float32) * (rank + 1)
    red = torch.empty(1 << 10, device="cuda")
    dist.reduce_scatter_tensor(red, rows, group=group)
    me = members.index(rank)
    expect_red = sum(torch.arange(2 << 10, device="cuda", dtype=torch.float32)[me << 10:(me + 1) << 10]
                     * (m + 1) for m in members)
    gathered_ok = all(bool((out[i << 20:(i + 1) << 20] == m + 1).all()) for i, m in enumerate(members))
    return gathered_ok, bool(torch.equal(red, expect_red))


# ODC_TRANSPORT=nvshmem: every peer through NVSHMEM's on-stream calls; ODC_HOST_SIZE=2 on 4
# GPUs: two "hosts" of two, peer-to-peer within a pair and NVSHMEM across (the mixed path);
# ODC_NVSHMEM_STAGE=always: every routed copy takes the network peers' path (staged through
# the slab) although NVSHMEM maps the peer
SPLITS = {"all_peers_nvshmem": (2, {"ODC_TRANSPORT": "nvshmem"}),
          "all_peers_staged": (2, {"ODC_TRANSPORT": "nvshmem", "ODC_NVSHMEM_STAGE": "always"}),
          "two_hosts_of_two": (4, {"ODC_HOST_SIZE": "2"}),
          "two_hosts_staged": (4, {"ODC_HOST_SIZE": "2", "ODC_NVSHMEM_STAGE": "always"})}


@pytest.mark.parametrize("split", list(SPLITS))
def test_gpu_collectives_and_decoupled_over_nvshmem(split):
    world, extra = SPLITS[split]
    remote = _remote_env()
    shared = remote or os.environ.get("ODC_TEST_NVSHMEM_SHARED_GPU") == "1"
    if not odc_nvshmem.available() or torch.cuda.device_count() < (1 if shared else world):
        pytest.skip(f"needs >= {world} CUDA GPUs (or ODC_TEST_NVSHMEM_SHARED_GPU=1 and one) and "
                    "an ODC_WITH_NVSHMEM=1 build")
    results = run_distributed(_collectives_worker, world, backend="cpu:gloo,cuda:odc",
                              env=dict(GPU_ENV, **extra), deadline_s=300)
    from test_decoupled import TOL, assert_grads_match

    staged = remote or extra.get("ODC_NVSHMEM_STAGE") == "always"
    for rank, (ag_equal, rs_err, used, decoupled, (refused, chosen), sub, up) in results.items():
        slab_used, copies, signals, staged_copies, network_peers = used
        assert up[0] >= 2 and up[1] == up[2], f"rank {rank}: after init_process_group (status, slab, default) {up}"
        assert ag_equal, rank
        if sub is not None:
            assert sub == (True, True), f"rank {rank}: cross-host sub-group (all-gather, reduce-scatter) {sub}"
        assert rs_err < 1e-4, (rank, rs_err)
        assert slab_used > 0, "the odc window did not come from NVSHMEM's symmetric heap"
        assert copies > 0 and signals > 0, "no get / put / signal went through NVSHMEM"
        assert (staged_copies > 0) == staged, (rank, split, remote, staged_copies)
        if remote:
            assert network_peers > 0, f"rank {rank}: NVSHMEM mapped every peer: no remote transport"
        assert refused is not None and "accumulate='local'" in refused, refused
        assert chosen == "local", (rank, chosen)
        cfg = decoupled["bf16_local"]
        assert "error" not in cfg, f"rank {rank}:\n{cfg.get('error')}"
        assert_grads_match(cfg, TOL[True], rank)


def _model_sized_worker(rank, world):
    """The backend brought NVSHMEM up with the default slab; init(model=...) after
    fully_shard grows it by what the model's windows and arena do not find room for,
    decoupled training runs over it, and a later growth past the heap's first size (the
    default slab + 512 MiB) still works for a new group's window."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp_models as fm
    import torch_odc_backend as odc
    from test_decoupled import _microbatch_loss

    torch.cuda.set_device(rank)
    first = odc_nvshmem.status()
    model, opt = fm.build(init_device_mesh("cuda", (world,)), seed=5, device="cuda")
    blocks = odc_nvshmem.blocks_for(model)
    fresh = odc_nvshmem.init(model=model)
    sized = odc_nvshmem.status()
    odc.decouple(model, opt, accumulate="local")  # finds room: no further growth
    losses = []
    for step in range(2):
        for mb in range(2):
            loss = _microbatch_loss(model, 2 * rank + mb, step, device="cuda")
            loss.backward()
            losses.append(float(loss))
        odc.sync(model)
        opt.step()
        opt.zero_grad()
    trained = odc_nvshmem.status()
    big = odc_nvshmem.ensure_room([2 << 30])  # a 2 GiB segment: past NVSHMEM_SYMMETRIC_SIZE
    again = odc_nvshmem.ensure_room([2 << 30])  # room now: nothing added
    ok = True
    for _ in range(3):  # new windows fill the default slab, then land in the new segment
        group = dist.new_group(backend="cpu:gloo,cuda:odc")
        mine = torch.full((1 << 20,), float(rank + 1), device="cuda")
        out = torch.empty(world << 20, device="cuda")
        dist.all_gather_into_tensor(out, mine, group=group)
        ok &= all(bool((out[i << 20:(i + 1) << 20] == i + 1).all()) for i in range(world))
    return (fresh, first, blocks, sized, trained, big, again, ok, losses, odc_nvshmem.status())


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not odc_nvshmem.available(),
                    reason="needs >= 2 CUDA GPUs and an ODC_WITH_NVSHMEM=1 build")
def test_gpu_backend_brings_nvshmem_up_and_the_slab_grows():
    results = run_distributed(_model_sized_worker, 2, backend="cpu:gloo,cuda:odc",
                              env=dict(GPU_ENV, ODC_TRANSPORT="nvshmem"), deadline_s=240)
    for rank, (fresh, first, blocks, sized, trained, big, again, ok, losses, last) in results.items():
        what = f"rank {rank}"
        assert first["init_status"] >= 2 and first["my_pe"] == rank, (what, first)
        assert first["slab_bytes"] == odc_nvshmem.default_slab_bytes(2), (what, first)
        assert fresh is False, what  # joined the backend's initialisation
        # the default slab holds the two windows; the arena (> 64 MiB headroom? then) grows it
        assert sized["slab_bytes"] >= first["slab_bytes"], (what, sized)
        fits = sized["slab_bytes"] - first["slab_bytes"]
        assert fits in (0, (blocks[-1] + 4095) // 4096 * 4096), (what, blocks, first, sized)
        assert trained["slab_bytes"] == sized["slab_bytes"], (what, "decouple grew it again", trained)
        assert trained["slab_used"] > first["slab_used"], (what, trained)
        assert big == 2 << 30 and again == 0, (what, big, again)
        assert last["slab_bytes"] == sized["slab_bytes"] + (2 << 30), (what, last)
        assert last["segments"][-1][1] > 0, f"{what}: no window in the grown segment {last['segments']}"
        assert ok, f"{what}: all-gather over a window in the grown slab"
        assert all(x == x and abs(x) < 1e6 for x in losses), (what, losses)


def _torch_first_worker(rank, world):
    import os

    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    torch.cuda.set_device(rank)
    symm_mem.set_backend("NVSHMEM")  # PyTorch initialises NVSHMEM first, over the world
    t = symm_mem.empty(1024, device="cuda")
    symm_mem.rendezvous(t, dist.group.WORLD.group_name)
    up_before = odc_nvshmem.status()["init_status"] >= 2  # one NVSHMEM in the process
    fresh = odc_nvshmem.init(slab_bytes=odc_nvshmem.default_slab_bytes(world))
    selftest = odc_nvshmem.ring_selftest(1 << 20)
    os.environ["ODC_TRANSPORT"] = "nvshmem"  # read when the group is created
    group = dist.new_group(backend="cpu:gloo,cuda:odc")
    mine = torch.full((1 << 20,), float(rank + 1), device="cuda")
    out = torch.empty(world << 20, device="cuda")
    dist.all_gather_into_tensor(out, mine, group=group)
    ok = all(bool((out[i << 20:(i + 1) << 20] == i + 1).all()) for i in range(world))
    return up_before, fresh, selftest["mismatched_bytes"], ok, odc_nvshmem.status()["routed_copies"]


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not odc_nvshmem.available(),
                    reason="needs >= 2 CUDA GPUs and an ODC_WITH_NVSHMEM=1 build")
def test_gpu_nvshmem_joins_pytorch_symmetric_memory():
    """PyTorch's symmetric memory (NVSHMEM backend) initialises NVSHMEM first; odc joins it
    (init returns False), carves its slab from the same heap and runs collectives over it.
    (The other order, odc first, was checked on 2 x H200: docs/performance.md.)"""
    results = run_distributed(_torch_first_worker, 2, backend="cpu:gloo,cuda:nccl", env=GPU_ENV,
                              deadline_s=240)
    for rank, (up_before, fresh, mismatched, ok, routed) in results.items():
        assert up_before and fresh is False, (rank, up_before, fresh)
        assert mismatched == 0 and ok and routed > 0, (rank, mismatched, ok, routed)


_UNREACHABLE_PEER = r'''
import os, sys, datetime, torch, torch.distributed as dist
import torch_odc_backend  # noqa: F401
rank = int(sys.argv[1])
torch.cuda.set_device(rank % torch.cuda.device_count())
dist.init_process_group("cpu:gloo,cuda:odc", store=dist.FileStore(sys.argv[2], 2), rank=rank,
                        world_size=2, timeout=datetime.timedelta(seconds=60))
print("initialised", flush=True)
'''


def _has_rdma_device() -> bool:
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


@pytest.mark.skipif(not torch.cuda.is_available() or not odc_nvshmem.available(),
                    reason="needs a CUDA GPU and an ODC_WITH_NVSHMEM=1 build")
def test_gpu_unreachable_peer_ends_the_process_not_hangs(tmp_path):
    """With peer-to-peer off and no NIC, NVSHMEM finds no transport to the other rank and ends
    the process itself during init_process_group (no hang; the README says what to check)."""
    import subprocess
    import sys

    if _has_rdma_device() or os.path.exists("/dev/gdrdrv"):
        pytest.skip("this machine has an RDMA device or GDRCopy: NVSHMEM may reach the peer")
    env = dict(os.environ, **GPU_ENV, ODC_TRANSPORT="nvshmem", NVSHMEM_DISABLE_P2P="1")
    env.pop("NVSHMEM_REMOTE_TRANSPORT", None)
    script = tmp_path / "peer.py"
    script.write_text(_UNREACHABLE_PEER)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "store")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode != 0 and "initialised" not in out, (r, p.returncode, out[-2000:])
        assert "Unable to initialize any transports" in err, (r, err[-3000:])
