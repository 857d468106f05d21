"""Ranks on different hosts where odc's transport reaches only this host's peers: the first
collective raises a clear error on every rank (naming both hosts and what to do) instead of
failing obscurely or timing out. Rank 1 gets a host name of its own in a new UTS namespace
(needs the privilege to create one; skipped, loudly, without it)."""
import ctypes
import os
import socket

import pytest
import torch

from dist_utils import run_distributed

CLONE_NEWUTS = 0x04000000


def _other_host_worker(rank, world):
    import torch.distributed as dist

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUTS) != 0:  # every rank tries: the same privileges everywhere
        return "skip", os.strerror(ctypes.get_errno())
    if rank == 1:
        socket.sethostname("odc-test-other-host")
    try:
        x = torch.full((4,), float(rank))
        out = torch.empty(4 * world)
        dist.all_gather_into_tensor(out, x)
        return "no error", out.tolist()
    except ValueError as e:
        return "raised", str(e)


def test_cpu_peers_on_other_hosts_fail_clearly():
    res = run_distributed(_other_host_worker, 2, backend="cpu:odc", timeout_s=30, deadline_s=120)
    if res[0][0] == "skip":
        pytest.skip(f"cannot give a rank its own host name here (unshare: {res[0][1]})")
    for rank, (what, detail) in res.items():
        assert what == "raised", (rank, what, detail)
        assert "odc-test-other-host" in detail and "cpu:gloo,cuda:odc" in detail, (rank, detail)


def _other_host_cuda_worker(rank, world):
    import torch.distributed as dist

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUTS) != 0:
        return "skip", os.strerror(ctypes.get_errno())
    if rank == 1:
        socket.sethostname("odc-test-other-host")
    try:
        x = torch.full((4,), float(rank), device="cuda")
        out = torch.empty(4 * world, device="cuda")
        dist.all_gather_into_tensor(out, x)
        torch.cuda.synchronize()
        return "no error", out.tolist()
    except ValueError as e:
        return "raised", str(e)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_peers_on_other_hosts_name_odc_host_size():
    """CUDA IPC reaches only this host's GPUs: without ODC_HOST_SIZE saying where the hosts
    split, a peer on another host fails at set-up with the variable named."""
    res = run_distributed(_other_host_cuda_worker, 2, backend="cpu:gloo,cuda:odc", timeout_s=60,
                          deadline_s=180)
    if res[0][0] == "skip":
        pytest.skip(f"cannot give a rank its own host name here (unshare: {res[0][1]})")
    for rank, (what, detail) in res.items():
        assert what == "raised", (rank, what, detail)
        assert "odc-test-other-host" in detail and "ODC_HOST_SIZE" in detail, (rank, detail)
