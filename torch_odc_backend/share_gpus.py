"""Run a training script with more ranks than GPUs: LOCAL_RANK folded onto the visible GPUs.

NCCL refuses two ranks on one GPU; odc runs them ("Several ranks on one GPU" in the README).
Scripts that pick their GPU from ``LOCAL_RANK`` (``cuda:LOCAL_RANK``: torchtitan, many
loops) then ask for a GPU that does not exist. Under torchrun, this runs the script with
``LOCAL_RANK`` replaced by ``LOCAL_RANK % torch.cuda.device_count()``, so world size 2-8
runs on a one-GPU workstation::

    torchrun --standalone --nproc-per-node=4 -m torch_odc_backend.share_gpus train.py ARGS
    ODC_DEFAULT_BACKEND=cuda torchrun --standalone --nproc-per-node=2 \\
        -m torch_odc_backend.share_gpus -m torchtitan.train --job.config_file debug.toml

Ranks and world size are untouched (``RANK``, ``WORLD_SIZE``); the process group must be
odc's (``ODC_DEFAULT_BACKEND=cuda``, ``"cpu:gloo,cuda:odc"``) since NCCL would refuse the
shared GPUs. For correctness and debugging: ranks sharing a GPU take turns on it.
"""
from __future__ import annotations

import os
import sys

from . import _script

USAGE = "usage: python -m torch_odc_backend.share_gpus (SCRIPT | -m MODULE) [ARGS...]"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not _script.is_target(argv) or argv[0] in ("-h", "--help"):
        raise SystemExit(USAGE)
    import torch

    count = torch.cuda.device_count()  # counts devices without creating a CUDA context
    if count < 1:
        raise SystemExit("torch_odc_backend.share_gpus: no CUDA device is visible")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ["LOCAL_RANK"] = str(local_rank % count)
    _script.run(argv)


if __name__ == "__main__":
    main()
