"""Every fenced code block of README.md runs somewhere, chosen by the marker comment on the line
before it (``<!-- readme-test: KIND -->``, parsed by ``.ci/readme_block.py``):

- ``install`` and ``tests``: ``.ci/run`` runs them verbatim on the clean CI machine (the
  install block in a fresh virtual environment); here we check that it still does;
- ``example``: ``bash examples/run.sh``, run with its install lines skipped and few steps;
- ``torchrun``: a script, run under torchrun with 2 CPU processes exactly as written;
- ``torchrun-continued``: inserted into the preceding ``torchrun`` script before its
  ``del model`` line (the script then runs once, with its continuations);
- ``layout``: a tree of the repository, whose paths must exist.

A block without a marker or with an unknown kind fails the test."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("readme_block", REPO / ".ci" / "readme_block.py")
readme_block = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(readme_block)

BLOCKS = readme_block.blocks()
KINDS = {"install", "tests", "example", "torchrun", "torchrun-continued", "layout"}
ENV = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # CPU, as in CI


def _one(kind):
    found = [body for k, _, body in BLOCKS if k == kind]
    assert len(found) == 1, f"{len(found)} README blocks of kind {kind}"
    return found[0]


def _torchrun(script: str, tmp_path: Path) -> str:
    path = tmp_path / "readme_script.py"
    path.write_text(script)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", str(path)],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{out[-3000:]}"
    assert "terminate called" not in out, out[-3000:]
    return out


def test_every_block_has_a_known_kind():
    assert BLOCKS, "no code blocks found in README.md"
    unknown = [(k, body.splitlines()[0] if body.strip() else "") for k, _, body in BLOCKS if k not in KINDS]
    assert not unknown, f"README blocks without a known readme-test marker: {unknown}"
    assert sum(k == "torchrun-continued" for k, _, _ in BLOCKS) <= sum(k == "torchrun" for k, _, _ in BLOCKS)


def test_ci_runs_the_install_and_test_blocks():
    ci = (REPO / ".ci" / "run").read_text()
    # .ci/run executes exactly these blocks, so they cannot drift from what CI runs
    assert re.search(r"readme_block\.py install\b", ci) and re.search(r"readme_block\.py tests\b", ci), ci
    assert "source .venv/bin/activate" in ci
    install = _one("install")
    assert "python3 -m venv .venv" in install and "--no-build-isolation" in install, install
    assert _one("tests").strip() == "python -m pytest -q tests"


def test_layout_block_names_existing_paths():
    for line in _one("layout").splitlines():
        path = line.split()[0] if line.strip() else ""
        assert path and (REPO / path).exists(), f"README layout names {path!r}, which does not exist"


def test_example_block_trains():
    cmd = _one("example").strip()
    assert cmd == "bash examples/run.sh", cmd
    bin_dir = str(Path(sys.executable).parent)  # run.sh takes python3 from PATH: this interpreter
    env = dict(ENV, ODC_SKIP_INSTALL="1", PATH=bin_dir + os.pathsep + ENV.get("PATH", ""))
    proc = subprocess.run(["bash", "-c", cmd + " --steps 2"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{out[-3000:]}"
    assert "[train_fsdp2] done: loss" in out, out[-3000:]
    # and exits cleanly: no inner gloo group left to interpreter shutdown (tests/test_teardown.py)
    assert "terminate called" not in out, out[-3000:]


def _scripts():
    """(name, script) for every torchrun block, with its continuation blocks spliced in before
    its ``del model`` line: one run covers a block and its continuations (CI time)."""
    scripts = []
    for kind, _, body in BLOCKS:
        if kind == "torchrun":
            scripts.append([f"block{len(scripts)}", body])
        elif kind == "torchrun-continued":
            assert scripts, "a torchrun-continued block before any torchrun block"
            name, base = scripts[-1]
            assert "\ndel model" in base, "the script to continue has no 'del model' line"
            cut = base.index("\ndel model") + 1
            scripts[-1] = [name + "-continued", base[:cut] + body + base[cut:]]
    return scripts


@pytest.mark.parametrize("name,script", _scripts(), ids=[n for n, _ in _scripts()])
def test_torchrun_block_runs_on_two_cpu_ranks(name, script, tmp_path):
    out = _torchrun(script, tmp_path)
    assert re.search(r"rank 0: loss \d", out) and re.search(r"rank 1: loss \d", out), out[-3000:]
    if name.endswith("-continued"):
        # the decoupled block says it trained: its last loss and this rank's microbatch count
        # (rank r runs 1 + r per step, 5 steps)
        done = {int(r): int(n) for r, n in
                re.findall(r"rank (\d): decoupled loss \d+\.\d+ after (\d+) microbatches", out)}
        assert done == {0: 5, 1: 10}, out[-3000:]
