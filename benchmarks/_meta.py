"""What every benchmark result records: the machine label, the commit, the UTC date.

Imported by the scripts in this folder (``python benchmarks/<script>.py`` puts the folder on
``sys.path``).
"""
from __future__ import annotations

import datetime
import os
import re
import subprocess
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


def machine_kind(device: torch.device, world: int) -> str:
    """``$ODC_BENCH_KIND``, else ``<gpu name>-x<ranks>`` (``cpu-x<ranks>`` on CPU)."""
    if os.environ.get("ODC_BENCH_KIND"):
        return os.environ["ODC_BENCH_KIND"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"{slug(name)}-x{world}"


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def result_path(out_dir: str | Path, benchmark: str, kind: str, suffix: str = "") -> Path:
    """``<out_dir>/<benchmark>_<kind><suffix>_<yyyymmdd UTC>.json`` (its folder created)."""
    out = Path(out_dir) / f"{benchmark}_{kind}{suffix}_{utc_now():%Y%m%d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def stamp(device: torch.device) -> dict:
    """Commit, date and versions for a result file."""
    commit, dirty = git_commit()
    return {"commit": commit, "commit_dirty": dirty,
            "date": utc_now().isoformat(timespec="seconds"), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None}
