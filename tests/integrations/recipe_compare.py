"""Running a recipe's ``compare`` subcommand from a test: its result JSON, or a failure
that shows the command's output and the runs' logs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "examples" / "recipes"
# its sitecustomize: no garbage collection at the exit of the command or of the runs it starts
FAST_EXIT = Path(__file__).resolve().parent / "fast_exit"


def run_compare(driver: str, result_file: str, work: Path, *args: str, timeout: float = 900,
                verdict: bool = False) -> dict:
    """``python examples/recipes/<driver> compare --work WORK ARGS``; ``verdict``: the output
    must also say ``VERDICT: PASS``."""
    cmd = [sys.executable, str(RECIPES / driver), "compare", "--work", str(work), *args]
    path = [str(FAST_EXIT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)),
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(work.glob("*.log")))
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-3000:]}\n{logs}")
    if verdict:
        assert "VERDICT: PASS" in proc.stdout, proc.stdout[-3000:]
    return json.loads((work / result_file).read_text())
