"""What every benchmark result records: the machine label, the commit, the UTC date.

Imported by the scripts in this folder (``python benchmarks/<script>.py`` puts the folder on
``sys.path``).
"""
from __future__ import annotations

import datetime
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> tuple[str, bool | None]:
    """($ODC_COMMIT, None) when set (a copied working tree may carry a stale .git), else
    (commit, dirty) from git, else ('unknown', None)."""
    if os.environ.get("ODC_COMMIT"):
        return os.environ["ODC_COMMIT"], None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10)
        if head.returncode == 0 and head.stdout.strip():
            st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True, timeout=10)
            return head.stdout.strip(), bool(st.stdout.strip()) if st.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown", None


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def lab_info(device: torch.device, world: int) -> dict | None:
    """The one-GPU lab's settings when run by ``benchmarks/lab.sh`` (it sets ODC_LAB_MPS=1),
    else None."""
    if device.type != "cuda" or os.environ.get("ODC_LAB_MPS") != "1":
        return None
    return {"mps": True, "ranks_per_gpu": world,
            "active_thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")}


def machine_kind(device: torch.device, world: int) -> str:
    """``$ODC_BENCH_KIND``, else ``<gpu>-x<ranks>`` with the GPU's name short of its memory
    suffix ("NVIDIA H100 80GB HBM3" -> nvidia-h100, as the machine kinds are named, so a rerun
    replaces its headline file), ``<gpu>-mps-x<ranks>`` in the lab, ``cpu-x<ranks>`` on CPU."""
    if os.environ.get("ODC_BENCH_KIND"):
        return os.environ["ODC_BENCH_KIND"]
    if device.type != "cuda":
        return f"cpu-x{world}"
    gpu = re.sub(r"-\d+gb(-.*)?$", "", slug(torch.cuda.get_device_name(device)))
    return f"{gpu}-mps-x{world}" if lab_info(device, world) else f"{gpu}-x{world}"


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def default_out_dir() -> Path:
    """Where a benchmark writes its result files unless given ``--out-dir``: a folder under the
    system's temporary directory, so that a run leaves the checkout as it was.
    ``--out-dir benchmarks/results`` writes (and replaces) the committed headline files."""
    return Path(tempfile.gettempdir()) / "odc_results"


OUT_DIR_HELP = ("folder of the result files (default: %(default)s, outside the checkout; "
                "benchmarks/results writes the committed headline files)")


def result_path(out_dir: str | Path, benchmark: str, kind: str, suffix: str = "") -> Path:
    """``<out_dir>/<benchmark>_<kind><suffix>_<yyyymmdd UTC>.json`` (its folder created)."""
    out = Path(out_dir) / f"{benchmark}_{kind}{suffix}_{utc_now():%Y%m%d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def stamp(device: torch.device, world: int | None = None) -> dict:
    """Commit, date, versions, the lab's settings and the allocator's (for a result file)."""
    commit, dirty = git_commit()
    out = {"commit": commit, "commit_dirty": dirty,
           "date": utc_now().isoformat(timespec="seconds"), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None}
    if world is not None:
        out["lab"] = lab_info(device, world)
        out["pytorch_cuda_alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    return out
