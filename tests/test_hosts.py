"""Groups whose ranks are on several hosts: odc serves the ranks its transports reach (one
host's shared memory or CUDA IPC) and leaves groups that span hosts to their inner gloo /
NCCL group; what it must serve one-sidedly across hosts (decoupled mode) fails at once with
an error naming the hosts and what to do. Never a set-up error, a hang or wrong data.

Hosts are emulated two ways: ODC_HOST_SIZE=2 on world 4 (what ``torch_odc_backend.emulate_hosts``
sets; the CI tests), and a rank with a host name of its own in a new UTS namespace (needs the
privilege to create one; skipped, loudly, without it). The GPU tests run 4 GPUs as 2 hosts x 2
through the launcher, NCCL connecting the hosts through its network transport."""
import ctypes
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_utils import GPU_ENV, gpu_test, run_distributed, run_once

CLONE_NEWUTS = 0x04000000
REPO = Path(__file__).resolve().parents[1]
TWO_HOSTS = {"ODC_HOST_SIZE": "2"}


# ---- a rank on a host of another name

def _other_host_worker(rank, world, device):
    import torch.distributed as dist

    from torch_odc_backend._backend import backend_stats

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUTS) != 0:  # every rank tries: the same privileges everywhere
        return "skip", os.strerror(ctypes.get_errno())
    if rank == 1:
        socket.sethostname("odc-test-other-host")
    x = torch.full((4,), float(rank + 1), device=device)
    out = torch.empty(4 * world, device=device)
    dist.all_gather_into_tensor(out, x)
    red = torch.empty(2, device=device)
    dist.reduce_scatter_tensor(red, torch.arange(2.0 * world, device=device) * (rank + 1))
    hosts = dist.group.WORLD._get_backend(torch.device(device)).hosts(torch.device(device))
    return "ran", out.tolist(), red.tolist(), hosts, backend_stats(device=device)


def _check_served_across_hosts(res, world):
    if res[0][0] == "skip":
        pytest.skip(f"cannot give a rank its own host name here (unshare: {res[0][1]})")
    weight = sum(range(1, world + 1))
    for rank, (what, gathered, reduced, hosts, stats) in res.items():
        assert gathered == [float(r + 1) for r in range(world) for _ in range(4)], rank
        assert reduced == [float(weight * (2 * rank + i)) for i in range(2)], rank
        assert "odc-test-other-host' (rank 1)" in hosts, (rank, hosts)
        assert stats.get("cross_host_ops") == 2 and "all_gather_ops" not in stats, (rank, stats)


def test_cpu_peers_on_other_hosts_are_served_by_gloo():
    """Shared memory reaches one host: a group across hosts moves CPU tensors with gloo."""
    res = run_distributed(_other_host_worker, 2, "cpu", backend="cpu:odc", timeout_s=30, deadline_s=120)
    _check_served_across_hosts(res, 2)


@gpu_test(2)
def test_gpu_peers_on_other_hosts_are_served_by_nccl():
    """CUDA IPC reaches one host (and this build may have no NVSHMEM): a group across hosts
    moves CUDA tensors with NCCL."""
    res = run_distributed(_other_host_worker, 2, "cuda", backend="cpu:gloo,cuda:odc", timeout_s=60,
                          deadline_s=180, env=GPU_ENV)
    _check_served_across_hosts(res, 2)


# ---- 4 ranks as 2 hosts x 2 (ODC_HOST_SIZE=2)

def _mesh_on(backend, device, shape, names):
    """A DeviceMesh of the world's ranks in ``shape`` on groups of ``backend`` (gloo, nccl)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device, shape, mesh_dim_names=names,
                            backend_override={n: backend for n in names})


def _two_hosts_worker(rank, world, device="cpu", reference="gloo"):
    """Exact HSDP (odc inside a host, the inner backend across) against the reference
    backend; decoupled HSDP with uneven microbatch counts against exact; a full-shard group
    spanning the hosts (exact: against the reference; decoupled: refused)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import torch_odc_backend as odc
    from fsdp_models import build
    from test_decoupled import _train

    def train(mesh, decoupled=False, last_hint=False):
        return _train(mesh, decoupled=decoupled, bf16=False, delays=decoupled, device=device,
                      last_hint=last_hint)

    hsdp = init_device_mesh(device, (2, 2), mesh_dim_names=("replicate", "shard"))
    flat = init_device_mesh(device, (world,), mesh_dim_names=("flat",))
    groups = {"replicate": hsdp.get_group("replicate"), "shard": hsdp.get_group("shard"),
              "flat": flat.get_group()}
    out = {"exact_hsdp": train(hsdp),
           "reference_hsdp": train(_mesh_on(reference, device, (2, 2), ("r_replicate", "r_shard"))),
           # rank (step % 4) runs half the microbatches, the next rank none (test_decoupled)
           "decoupled_hsdp": train(hsdp, decoupled=True),
           # the cross-host all-reduces started in each rank's last backward
           "decoupled_hsdp_last": train(hsdp, decoupled=True, last_hint=True),
           "exact_flat": train(flat),
           "reference_flat": train(_mesh_on(reference, device, (world,), ("r_flat",)))}
    out["stats"] = {n: odc.backend_stats(g, device) for n, g in groups.items()}
    out["hosts"] = {n: g._get_backend(torch.device(device)).hosts(torch.device(device))
                    for n, g in groups.items()}
    model, opt = build(flat, seed=3, device=device)
    try:
        odc.decouple(model, opt)
        out["decouple_flat"] = None
    except ValueError as e:
        out["decouple_flat"] = str(e)
    out["backward_after_last"] = _backward_after_last(hsdp, device)
    dist.barrier()
    return out


def _backward_after_last(mesh, device):
    """A backward after the one odc.last_microbatch announced raises (its gradients would
    miss the reductions already started); returns the error's text."""
    import torch_odc_backend as odc
    from fsdp_models import build
    from test_decoupled import _microbatch_loss

    model, opt = build(mesh, seed=3, device=device)
    odc.decouple(model, opt)
    odc.last_microbatch(model)
    _microbatch_loss(model, 0, 0, device).backward()
    try:
        _microbatch_loss(model, 1, 0, device).backward()
    except RuntimeError as e:
        return str(e)
    finally:
        if device == "cuda":
            torch.cuda.synchronize()
    return None


_two_hosts = run_once(lambda: run_distributed(_two_hosts_worker, 4, backend="cpu:odc", env=TWO_HOSTS,
                                              timeout_s=60, deadline_s=300))


def _assert_close(got, want, what):
    for name, w in want.items():
        if w is not None:  # fp32: only the reductions' summation order differs
            torch.testing.assert_close(got[name], w, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what} {name}: {m}")


def check_exact_hsdp(results):
    for rank, r in results.items():
        _assert_close(r["exact_hsdp"]["params"], r["reference_hsdp"]["params"], f"rank {rank} HSDP params")
        stats = r["stats"]
        assert stats["shard"].get("all_gather_ops", 0) > 0, stats  # odc inside a host
        assert "cross_host_ops" not in stats["shard"] and r["hosts"]["shard"] == "", stats
        assert stats["replicate"].get("delegated_ops", 0) > 0, stats  # the inner backend across


def check_decoupled_hsdp(results):
    for rank, r in results.items():
        for run in ("decoupled_hsdp", "decoupled_hsdp_last"):
            for step, (got, want) in enumerate(zip(r[run]["grads"], r["exact_hsdp"]["grads"])):
                _assert_close(got, want, f"rank {rank} {run} step {step} grad")
            _assert_close(r[run]["params"], r["exact_hsdp"]["params"], f"rank {rank} {run} params")
        # started early on ranks that ran a microbatch (every group but the root, which the
        # backward reduces last: test_decoupled's idle rank per step reduces in sync)
        assert r["decoupled_hsdp_last"]["metrics"]["early_all_reduces"] > 0, r["decoupled_hsdp_last"]["metrics"]
        assert r["decoupled_hsdp"]["metrics"]["early_all_reduces"] == 0
        msg = r["backward_after_last"]
        assert msg and "odc.last_microbatch" in msg and "again" in msg, msg


def check_full_shard_across_hosts(results):
    for rank, r in results.items():
        _assert_close(r["exact_flat"]["params"], r["reference_flat"]["params"], f"rank {rank} flat params")
        stats = r["stats"]["flat"]
        assert stats.get("cross_host_ops", 0) > 0 and "all_gather_ops" not in stats, stats
        hosts = r["hosts"]["flat"]
        assert " #0' (ranks 0, 1)" in hosts and " #1' (ranks 2, 3)" in hosts, hosts
        msg = r["decouple_flat"]
        assert msg and "odc.decouple" in msg and hosts in msg and "mesh_dim_names=('replicate', 'shard')" in msg, msg


def test_cpu_two_hosts_exact_hsdp_equals_gloo():
    check_exact_hsdp(_two_hosts())


def test_cpu_two_hosts_decoupled_hsdp_with_uneven_microbatches_equals_exact():
    check_decoupled_hsdp(_two_hosts())


def test_cpu_full_shard_across_hosts_runs_on_gloo_and_decoupled_mode_refuses_it():
    check_full_shard_across_hosts(_two_hosts())


# ---- the launcher

def test_emulate_hosts_sets_nccl_and_odc_hosts(tmp_path):
    from torch_odc_backend.emulate_hosts import host_env

    assert host_env(2, 3, 3) == {"NCCL_HOSTID": "odc-emulated-host1", "ODC_HOST_SIZE": "2"}
    with pytest.raises(ValueError, match="multi-node"):
        host_env(2, 0, 4)
    script = tmp_path / "show.py"
    script.write_text("import os, sys\nprint(os.environ['NCCL_HOSTID'], os.environ['ODC_HOST_SIZE'], sys.argv[1:])\n")
    env = dict(os.environ, LOCAL_RANK="3", RANK="3", PYTHONPATH=str(REPO))
    env.pop("ODC_HOST_SIZE", None)
    launch = [sys.executable, "-m", "torch_odc_backend.emulate_hosts", "2", str(script)]
    run = subprocess.run(launch + ["--x", "1"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["odc-emulated-host1", "2", "['--x',", "'1']"], run.stdout
    bad = subprocess.run(launch, env=dict(env, ODC_HOST_SIZE="4"), capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "ODC_HOST_SIZE=4" in bad.stderr, bad.stderr


# ---- 4 GPUs as 2 hosts x 2: this file under torchrun and the launcher, against NCCL

def _gpu_main(out_dir: str) -> None:
    """One rank of the GPU job (``torchrun ... -m torch_odc_backend.emulate_hosts 2
    tests/test_hosts.py OUT_DIR``): _two_hosts_worker on CUDA against NCCL."""
    import pickle

    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:odc")
    out = _two_hosts_worker(rank, dist.get_world_size(), "cuda", "nccl")
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(out))


@gpu_test(4)
def test_gpu_two_hosts_of_two_gpus_against_nccl(tmp_path):
    """Exact HSDP equals NCCL's, decoupled HSDP with uneven microbatch counts equals exact,
    a full-shard group across the hosts runs on NCCL and refuses decoupled mode; NCCL's own
    log shows the hosts connected through its network transport."""
    import pickle

    env = dict(os.environ, **GPU_ENV, NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,P2P,NET",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                          "-m", "torch_odc_backend.emulate_hosts", "2", __file__, str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=400)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-6000:]
    results = {r: pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(4)}
    check_exact_hsdp(results)
    check_decoupled_hsdp(results)
    check_full_shard_across_hosts(results)
    assert "via NET/Socket" in log, "NCCL did not connect the emulated hosts through its network transport"
    assert "has ranks on several hosts" in log  # odc's one note of the group it hands to NCCL


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _gpu_main(sys.argv[1])
