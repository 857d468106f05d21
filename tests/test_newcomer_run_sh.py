"""examples/run.sh says which Python it installs into before it installs anything, and refuses
a distribution's own Python (PEP 668: an EXTERNALLY-MANAGED file in the standard library of
an interpreter outside a virtual environment), naming the command that makes a virtual
environment.

Nothing is installed here: the interpreters run.sh gets are wrappers that record ``-m pip``
and ``-m torch.distributed.run`` instead of running them. The distribution's Python is this
machine's base interpreter with a home of its own (PYTHONHOME: a copy of its standard library
made of links, plus the marker), so sysconfig finds the marker as on Debian or Ubuntu."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
VENV_COMMAND = "python3 -m venv .venv && source .venv/bin/activate"


def _wrapper(path: Path, real: str, home: Path | None = None) -> Path:
    """An interpreter named ``path`` that runs ``real`` (with PYTHONHOME ``home``), except pip
    and torchrun, which it only prints."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n"
                    'if [ "$1" = "-m" ] && { [ "$2" = pip ] || [ "$2" = torch.distributed.run ]; }; then\n'
                    '    echo "INTERCEPTED $*"; exit 0\n'
                    "fi\n"
                    + (f"PYTHONHOME='{home}'; export PYTHONHOME\n" if home else "")
                    + f"exec '{real}' \"$@\"\n")
    path.chmod(0o755)
    return path


def _system_python(tmp_path: Path, managed: bool) -> tuple[Path, Path]:
    """(python3, its prefix): the base interpreter with a home of its own under tmp_path."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    stdlib = Path(sysconfig.get_path("stdlib"))  # the base's: a venv shares it
    home = tmp_path / "home"
    fake_stdlib = home / stdlib.relative_to(sys.base_prefix)
    fake_stdlib.mkdir(parents=True)
    for entry in stdlib.iterdir():
        if entry.name not in ("site-packages", "EXTERNALLY-MANAGED"):
            (fake_stdlib / entry.name).symlink_to(entry)
    (fake_stdlib / "site-packages").mkdir()  # nothing installed: no torch
    if managed:
        (fake_stdlib / "EXTERNALLY-MANAGED").write_text("[externally-managed]\nError=use apt\n")
    return _wrapper(tmp_path / "bin" / "python3", base, home), home


def _run_sh(env_extra: dict[str, str], path_first: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ODC_SKIP_INSTALL", "PYTHON", "PYTHONHOME", "VIRTUAL_ENV", "CONDA_PREFIX")}
    if path_first is not None:
        env["PATH"] = f"{path_first}{os.pathsep}{env.get('PATH', '')}"
    env.update(env_extra)
    return subprocess.run(["bash", "examples/run.sh", "--steps", "1"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)


def test_refuses_a_distribution_python_on_the_path(tmp_path):
    python3, home = _system_python(tmp_path, managed=True)
    proc = _run_sh({}, path_first=python3.parent)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert VENV_COMMAND in proc.stderr, out
    assert "EXTERNALLY-MANAGED" in proc.stderr, out
    assert "INTERCEPTED" not in out, out  # neither pip nor the training ran


def test_says_where_it_installs_before_installing(tmp_path):
    """A Python outside a virtual environment without the marker (pyenv's, a self-built one):
    run.sh names it and its prefix, and points to a virtual environment, then installs."""
    python3, home = _system_python(tmp_path, managed=False)
    proc = _run_sh({}, path_first=python3.parent)  # stops later: the stand-in has no torch
    out = proc.stdout
    said = f"installing what is missing into {home} (python "
    assert said in out, out + proc.stderr
    assert "not a virtual environment" in out and VENV_COMMAND in out, out
    pip = out.find("INTERCEPTED -m pip install")
    assert pip > out.index(said), out  # torch is missing there: pip comes, after the line


def test_python_variable_picks_the_interpreter(tmp_path):
    """PYTHON=... overrides python3 on the PATH; a virtual environment is named as one."""
    python = _wrapper(tmp_path / "venv-python", sys.executable)
    proc = _run_sh({"PYTHON": str(python)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"installing what is missing into {sys.prefix} (python " in proc.stdout, out
    if sys.prefix != sys.base_prefix:
        assert "a virtual environment)" in proc.stdout, out
    assert "INTERCEPTED -m torch.distributed.run" in proc.stdout, out
    assert f"with {python}" in proc.stdout, out

