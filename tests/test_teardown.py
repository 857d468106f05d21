"""Teardown: destroy_process_group stops the inner (delegation) backends, and the README's
main job — the FSDP2 example under torchrun — trains and exits cleanly.

Before odc forwarded shutdown to its inner gloo group, that group's worker threads lived
until the interpreter finalized and could release a work's tensors then (taking the GIL
from a finalizing interpreter: std::terminate), aborting about a third of example runs."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed

REPO = Path(__file__).resolve().parents[1]


def _destroy_then_delegate(rank, world):
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    t = torch.ones(1)
    dist.all_reduce(t)  # creates the inner gloo backend
    dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="shut down"):
        backend.inner("cpu")  # released by shutdown; a shut-down group takes no new work
    return float(t.item())


def test_destroy_process_group_shuts_down_inner_backends():
    assert run_distributed(_destroy_then_delegate, 2) == {0: 2.0, 1: 2.0}


def test_example_trains_and_exits_cleanly():
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(REPO / "examples" / "train_fsdp2.py"), "--steps", "5"],
        cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{out[-3000:]}"
    assert "terminate called" not in out, out[-3000:]
    assert "[train_fsdp2] done: loss" in out, out[-3000:]
