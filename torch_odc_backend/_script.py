"""Run a training script or module in this process, as ``python SCRIPT ARGS`` or ``python -m
MODULE ARGS`` would: what the launcher wrappers (share_gpus, emulate_hosts) end with."""
from __future__ import annotations

import os
import runpy
import sys


def run(argv: list[str]) -> None:
    """``argv``: ``SCRIPT ARGS...`` or ``-m MODULE ARGS...`` (checked by the caller)."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def is_target(argv: list[str]) -> bool:
    """Whether ``argv`` names something to run."""
    return bool(argv) and not (argv[0] == "-m" and len(argv) < 2)
