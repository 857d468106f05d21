"""Shared by the ``compare`` commands of hf_trainer_fsdp2.py and lightning_fsdp2.py: the
environment of the runs, launching them with a log each, comparing per-step losses, and the
verdict (printed; the exit status is non-zero when a check fails)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import odc_entry_point  # beside this file

REPO = Path(__file__).resolve().parents[2]
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def base_env(work: Path, shim: Path | None = None) -> dict:
    """The environment of every run: no ODC_DEFAULT_BACKEND (a run that wants the switch sets
    it), one CPU thread per process (the same CPU kernels in every run), this checkout first
    on PYTHONPATH with the entry-point record a source checkout lacks (odc_entry_point.py),
    and the test-only CPU shim before it where one is given."""
    env = {k: v for k, v in os.environ.items() if k != "ODC_DEFAULT_BACKEND"}
    env.update(GPU_ENV, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    path = [str(shim)] if shim else []
    path.append(str(REPO))
    record = odc_entry_point.ensure(work / "odc_entry_point")
    if record:
        path.append(str(record))
    env["PYTHONPATH"] = os.pathsep.join(path + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def torchrun(nproc: int, script: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            str(script), *args]


def run(cmd: list[str], env: dict, log: Path, out: Path, timeout: float) -> dict:
    """Run ``cmd`` with its output in ``log``; return the JSON it wrote to ``out`` with the
    wall time. A failed run raises with the log's tail (so ``compare`` exits non-zero)."""
    t0 = time.time()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{' '.join(cmd)}\nexited with {proc.returncode}; log {log}:\n{log.read_text()[-6000:]}")
    return dict(json.loads(out.read_text()), wall_s=round(time.time() - t0, 1), log=str(log))


def compare_losses(got: list[float], ref: list[float], rtol: float) -> dict:
    """Per-step losses: bitwise equal, or within ``rtol`` relative to the reference."""
    n = min(len(got), len(ref))
    abs_diff = [abs(x - y) for x, y in zip(got, ref)]
    rel_diff = [d / abs(y) if y else d for d, y in zip(abs_diff, ref)]
    return {"steps": len(got), "steps_reference": len(ref),
            "losses_bitwise_equal": len(got) == len(ref) and got == ref,
            "max_abs_loss_diff": max(abs_diff) if n else None,
            "max_rel_loss_diff": max(rel_diff) if n else None, "rtol": rtol,
            "equal": len(got) == len(ref) and n > 0 and max(rel_diff) <= rtol}


def verdict(checks: dict[str, tuple[bool, str]]) -> int:
    """Print one line per check and the verdict; return the exit status."""
    for name, (ok, detail) in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    passed = all(ok for ok, _ in checks.values())
    print(f"VERDICT: {'PASS' if passed else 'FAIL'} ({sum(ok for ok, _ in checks.values())}/{len(checks)} checks)")
    return 0 if passed else 1
