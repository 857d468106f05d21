"""ODC_STATS_DIR (every process writes its odc groups' counters at exit) and the
``torch_odc_backend.share_gpus`` launcher's refusals, on CPU under torchrun."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    import torch_odc_backend  # noqa: F401
    dist.init_process_group("cpu:odc")
    sub = dist.new_group([0, 1])
    dist.all_gather_into_tensor(torch.zeros(8), torch.ones(4) * dist.get_rank())
    dist.all_gather_into_tensor(torch.zeros(8), torch.ones(4), group=sub)
    dist.destroy_process_group()
""")


def test_stats_dir_written_at_exit(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    stats = tmp_path / "stats"
    env = dict(os.environ, ODC_STATS_DIR=str(stats), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script)], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        rec = json.loads((stats / f"odc_stats_rank{rank}.json").read_text())
        assert rec["rank"] == rank
        default = [g for g in rec["groups"] if g["default"]]
        sub = [g for g in rec["groups"] if not g["default"]]
        assert len(default) == 1 and len(sub) == 1, rec
        assert default[0]["ranks"] == [0, 1] and default[0]["stats"]["all_gather_ops"] == 1, rec
        assert sub[0]["stats"]["all_gather_ops"] == 1, rec


def test_share_gpus_refuses_without_arguments_or_gpus():
    run = lambda *a: subprocess.run([sys.executable, "-m", "torch_odc_backend.share_gpus", *a],  # noqa: E731
                                    cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "usage: python -m torch_odc_backend.share_gpus" in run().stderr
    if not torch.cuda.is_available():
        assert "no CUDA device is visible" in run("x.py").stderr
