"""Each rank's GPU memory over a verl run, for the comparison's memory figures
(examples/recipes/verl_sft.py: the peak, and what a rank holds while verl has offloaded).

Loaded through verl's ``VERL_USE_EXTERNAL_MODULES`` (imported with ``verl``) in every rank of
every run when ``ODC_RECIPE_MEMORY_DIR`` is set. A thread reads the device's used memory
(``torch.cuda.mem_get_info``: what ``nvidia-smi`` shows, so memory odc maps outside PyTorch's
allocator counts too) and PyTorch's reserved and allocated bytes every few milliseconds from when
CUDA is initialised, keeps the samples where one of them changed, and at exit writes
``rank<RANK>.json``: ``[[unix time, used, reserved, allocated], ...]`` (bytes).
It only reads: no call of verl's or odc's is changed, and the GPU's streams are not touched.
"""
from __future__ import annotations

import atexit
import json
import os
import threading
import time
from pathlib import Path

import torch

_DIR = os.environ.get("ODC_RECIPE_MEMORY_DIR", "")
_PERIOD_S = 0.004
_CHANGE = 1 << 20  # a sample is kept when a figure moved by a MiB or more (or a second passed)


def _watch(samples: list, stop: threading.Event) -> None:
    device = int(os.environ.get("LOCAL_RANK", "0"))
    while not stop.is_set() and not torch.cuda.is_initialized():
        time.sleep(0.05)
    last, last_t = None, 0.0
    while not stop.is_set():
        free, total = torch.cuda.mem_get_info(device)
        now = time.time()
        sample = (total - free, torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device))
        if last is None or any(abs(a - b) >= _CHANGE for a, b in zip(sample, last)) or now - last_t >= 1.0:
            samples.append((now, *sample))
            last, last_t = sample, now
        time.sleep(_PERIOD_S)


def _install(folder: Path) -> None:
    samples: list = []
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(samples, stop), daemon=True, name="odc-memory-probe")
    watcher.start()

    def write() -> None:
        stop.set()
        watcher.join(timeout=1.0)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(samples))

    atexit.register(write)


def read(folder: Path, start: float, end: float) -> dict:
    """The probe's files in ``folder``, per rank: the peak used GB over the run, and the least
    used GB between ``start`` and ``end`` (the first and last timed step's ends: with offload on,
    the least is what the rank holds while verl has offloaded), with PyTorch's reserved and
    allocated GB at that moment (used - reserved: outside PyTorch's allocator, the CUDA context
    and NCCL's and odc's own memory). Empty when no file was written."""
    ranks = sorted(folder.glob("rank*.json"), key=lambda p: int(p.stem[4:])) if folder.is_dir() else []
    keys = ("peak_used_gb", "least_used_between_steps_gb", "reserved_then_gb", "allocated_then_gb")
    out: dict = {k: [] for k in keys}
    for path in ranks:
        samples = json.loads(path.read_text())
        between = [s for s in samples if start <= s[0] <= end]
        least = min(between, key=lambda s: s[1]) if between else None
        out["peak_used_gb"].append(max((s[1] for s in samples), default=0) / 2**30)
        for key, i in (("least_used_between_steps_gb", 1), ("reserved_then_gb", 2), ("allocated_then_gb", 3)):
            out[key].append(least[i] / 2**30 if least is not None else None)
    return out if ranks else {}


if _DIR and torch.cuda.is_available():
    _install(Path(_DIR))
