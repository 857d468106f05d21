"""Zero code change: a plain FSDP2 script that never imports torch_odc_backend and never names
a backend trains on odc with ODC_DEFAULT_BACKEND alone, to the parameters the default
backend gives (gloo on CPU; NCCL on GPUs where each rank has its own, else the
single-process reference of tests/fsdp_models.py). Needs the package installed (its
torch.backends entry point), as `pip install -e .` does."""
from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fsdp_models as fm  # noqa: E402
from dist_utils import GPU_ENV, gpu_test, ranks_share_gpus  # noqa: E402

SCRIPT = Path(__file__).with_name("plain_fsdp2.py")
WORLD = 2
installed = any(e.name == "odc" for e in entry_points(group="torch.backends"))
pytestmark = pytest.mark.skipif(not installed, reason="torch_odc_backend is not installed as a package "
                                "(no torch.backends entry point): pip install --no-build-isolation -e .")


def _launch(tmp_path, name, device, switch):
    out = tmp_path / name
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ODC_")}
    env.update(GPU_ENV, OMP_NUM_THREADS="1", TORCH_DEVICE_BACKEND_AUTOLOAD="1")
    if switch:
        env["ODC_DEFAULT_BACKEND"] = switch
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           str(SCRIPT), "--out", str(out), "--device", device]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)], proc.stderr


def _check_odc_run(runs, stderr):
    for rank, r in enumerate(runs):
        assert r["backend"] == "odc", (rank, r["backend"])
        assert not r["imported_before_group"], "the script imported torch_odc_backend itself"
        assert r["stats"].get("all_gather_ops", 0) > 0 and r["stats"].get("reduce_scatter_ops", 0) > 0, r["stats"]
    assert "No backend of type" not in stderr, stderr[-2000:]


OLD_DEFAULT_GROUP = torch.cuda.is_available() and tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13)


@pytest.mark.gpu  # in the GPU suite too: a CPU group where a GPU is visible
@pytest.mark.skipif(OLD_DEFAULT_GROUP, reason="torch < 2.13 with a GPU: init_process_group() without a "
                    "backend creates only the accelerator's backend, none for CPU tensors")
def test_cpu_switch_trains_on_odc_like_gloo(tmp_path):
    odc, stderr = _launch(tmp_path, "odc", "cpu", "cpu")
    ref, _ = _launch(tmp_path, "default", "cpu", None)
    _check_odc_run(odc, stderr)
    for rank in range(WORLD):
        assert ref[rank]["backend"] == "gloo", ref[rank]["backend"]
        for key in ("losses", "norms"):
            torch.testing.assert_close(torch.tensor(odc[rank][key]), torch.tensor(ref[rank][key]),
                                       rtol=1e-5, atol=1e-6)
        for name, p in ref[rank]["params"].items():
            torch.testing.assert_close(odc[rank]["params"][name], p, rtol=1e-5, atol=1e-6)


@gpu_test()
def test_cuda_switch_trains_on_odc(tmp_path):
    odc, stderr = _launch(tmp_path, "odc", "cuda", "cuda")
    _check_odc_run(odc, stderr)
    if ranks_share_gpus(WORLD):  # NCCL cannot run here: the single-process reference instead
        ref = fm.reference_train(WORLD, clip_norm=0.05, device="cuda")
    else:
        ref, _ = _launch(tmp_path, "default", "cuda", None)
        assert all(r["backend"] == "nccl" for r in ref)
    for rank in range(WORLD):
        for key in ("losses", "norms"):
            torch.testing.assert_close(torch.tensor(odc[rank][key]), torch.tensor(ref[rank][key]),
                                       rtol=1e-4, atol=1e-5)
        for name, p in ref[rank]["params"].items():
            torch.testing.assert_close(odc[rank]["params"][name].cpu(), p.cpu(), rtol=1e-4, atol=1e-5)
