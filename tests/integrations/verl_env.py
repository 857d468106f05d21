"""The verl environment of the verl tests (test_verl.py, test_verl_actor.py): verl 0.9.1 pins
transformers below the version the other recipes use, so it lives in an environment of its own,
``ODC_TEST_VERL_PYTHON`` (default ``.venv-verl/bin/python`` of the checkout, which .ci/run
makes), run with this checkout on its ``PYTHONPATH``, and fast_exit/ (its sitecustomize: no garbage
collection at the exit of any process of the run)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VERL_PYTHON = Path(os.environ.get("ODC_TEST_VERL_PYTHON", REPO / ".venv-verl" / "bin" / "python"))
SHIM = REPO / "tests" / "integrations" / "verl_cpu_shim" / "sft_cpu.py"
PYTHONPATH = os.pathsep.join([str(REPO), str(REPO / "tests" / "integrations" / "fast_exit")])

needs_verl = pytest.mark.skipif(not VERL_PYTHON.exists(), reason=(
    f"no verl environment at {VERL_PYTHON} (make it as .ci/run does, or set ODC_TEST_VERL_PYTHON)"))


def run(args: list[str], timeout: float = 600, **env) -> subprocess.CompletedProcess:
    """``args`` under the verl environment's Python, from the checkout."""
    return subprocess.run([str(VERL_PYTHON), *args], cwd=REPO, env=dict(os.environ, PYTHONPATH=PYTHONPATH, **env),
                          capture_output=True, text=True, timeout=timeout)


def compare_on_cpu(recipe: str, result_file: str, work: Path, *args: str) -> dict:
    """``examples/recipes/<recipe> compare`` on CPU ranks through the CPU shim; its result, or a
    failure that shows its output and the runs' logs unless it printed ``VERDICT: PASS``."""
    proc = run([str(REPO / "examples" / "recipes" / recipe), "compare", "--work", str(work),
                "--device", "cpu", "--entry", str(SHIM), *args])
    if proc.returncode != 0 or "VERDICT: PASS" not in proc.stdout:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(work.glob("*.log")))
        pytest.fail(f"{recipe} compare exited with {proc.returncode}:\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-3000:]}\n{logs}")
    return json.loads((work / result_file).read_text())
