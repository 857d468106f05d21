"""Packaging: pyproject.toml declares what the code needs, and the check, at the compiled
core's first use, that torch_odc_backend._C was built for the running torch (no rebuild here:
fast)."""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_odc_backend
from torch_odc_backend import _build_check

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _names(requirements) -> dict[str, str]:
    """{distribution name: the whole requirement} for PEP 508 strings."""
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower(): r for r in requirements}


def _third_party_imports(paths) -> set[str]:
    """Top-level modules imported by these files, less the standard library and local ones."""
    paths = list(paths)
    local = {"torch_odc_backend", "_meta"} | {p.stem for path in paths for p in path.parent.glob("*.py")}
    found = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - local - {"__future__"}


# --- the build record and the check at first use -----------------------------------------

def test_installed_build_matches_running_torch():
    built = _build_check.built_info()
    assert built is not None, (
        f"no torch_odc_backend/_build_info.py beside {torch_odc_backend.__file__}: the "
        "extension was built before build records were kept; rebuild it with "
        "`pip install --no-build-isolation --no-deps -e .`")
    assert built["torch_version"] == torch.__version__
    assert built["torch_cuda"] == torch.version.cuda
    assert built["with_cuda"] == torch_odc_backend.built_with_cuda
    assert _build_check.mismatch(built, torch.__version__, torch.version.cuda) is None
    _build_check.check()  # passes (and _C is loaded) for the build under test


@pytest.mark.parametrize("built_version, running", [("2.11.0+cu130", "2.13.0+cpu"),
                                                    ("2.13.0", "2.14.1"), ("3.0.0", "2.13.0")])
def test_mismatch_names_both_versions_and_the_fix(built_version, running):
    built = {"torch_version": built_version, "torch_cuda": None, "with_cuda": False}
    msg = _build_check.mismatch(built, running, None)
    assert msg is not None
    assert built_version in msg and running in msg
    assert "pip install --no-build-isolation --no-deps -e ." in msg
    assert "pip install --no-build-isolation ." in msg


def test_same_minor_release_and_cpu_builds_are_accepted():
    cpu_build = {"torch_version": "2.13.0+cpu", "torch_cuda": None, "with_cuda": False}
    assert _build_check.mismatch(cpu_build, "2.13.1", None) is None
    assert _build_check.mismatch(cpu_build, "2.13.0+cu130", "13.0") is None  # CPU-only _C, CUDA torch
    cuda_build = {"torch_version": "2.11.0+cu130", "torch_cuda": "13.0", "with_cuda": True}
    assert _build_check.mismatch(cuda_build, "2.11.0+cu130", "13.0") is None
    assert _build_check.mismatch(cuda_build, "2.11.0+cu132", "13.2") is None


def test_cuda_build_needs_torch_with_the_same_cuda_major():
    cuda_build = {"torch_version": "2.11.0+cu130", "torch_cuda": "13.0", "with_cuda": True}
    msg = _build_check.mismatch(cuda_build, "2.11.0+cpu", None)
    assert msg and "has no CUDA" in msg and "2.11.0+cpu" in msg
    msg = _build_check.mismatch(cuda_build, "2.11.0+cu128", "12.8")
    assert msg and "13.0" in msg and "12.8" in msg


def test_check_raises_import_error_on_a_faked_mismatch(monkeypatch):
    fake = {"torch_version": "1.13.1", "torch_cuda": None, "with_cuda": False}
    monkeypatch.setattr(_build_check, "built_info", lambda: fake)
    with pytest.raises(ImportError, match=r"built against torch 1\.13\.1, but this is torch "
                       + re.escape(torch.__version__)):
        _build_check.check()


def test_check_warns_on_another_patch_release(monkeypatch):
    major, minor = torch.__version__.split(".")[:2]
    fake = {"torch_version": f"{major}.{minor}.99", "torch_cuda": torch.version.cuda,
            "with_cuda": torch_odc_backend.built_with_cuda}
    monkeypatch.setattr(_build_check, "built_info", lambda: fake)
    with pytest.warns(RuntimeWarning, match=re.escape(f"{major}.{minor}.99")):
        _build_check.check()


def test_failure_to_load_the_extension_says_how_to_rebuild(monkeypatch):
    def broken(name):
        raise ImportError(f"{name}.so: undefined symbol: _ZN3c1017RegisterOperatorsD1Ev")

    monkeypatch.setattr(_build_check.importlib, "import_module", broken)
    with pytest.raises(ImportError) as info:
        _build_check.check()
    msg = str(info.value)
    assert "undefined symbol" in msg and torch.__version__ in msg
    assert "pip install --no-build-isolation --no-deps -e ." in msg
    assert isinstance(info.value.__cause__, ImportError)


_FIRST_USES = """
import sys

import torch.distributed as dist

import torch_odc_backend as odc

assert odc.__file__.startswith(sys.argv[1]), odc.__file__
assert "torch_odc_backend._C" not in sys.modules, "the import loaded the compiled core"
odc.balance.lb_mini([3, 1], 2, 8, len)  # planning needs no compiled core
uses = {
    "odc.OdcBackend": lambda: odc.OdcBackend,
    "odc.decouple": lambda: odc.decouple,
    "odc.nvshmem": lambda: odc.nvshmem,
    "odc.backend_stats": lambda: odc.backend_stats,
    "init_process_group": lambda: dist.init_process_group(
        "cpu:odc", init_method="file://" + sys.argv[2], rank=0, world_size=1),
}
for use, run in uses.items():
    try:
        run()
    except Exception as e:  # c10d may wrap the creator's error
        print(f"{use}: {type(e).__name__}: {e}")
    else:
        print(f"{use}: no error")
"""


def test_a_build_for_another_torch_imports_and_fails_clearly_at_first_use(tmp_path):
    # the package's sources with a build record of another torch (the check stops before _C loads)
    pkg = tmp_path / "torch_odc_backend"
    shutil.copytree(ROOT / "torch_odc_backend", pkg,
                    ignore=shutil.ignore_patterns("_C.*", "_build_info.py", "__pycache__"))
    (pkg / "_build_info.py").write_text('torch_version = "1.13.1"\ntorch_cuda = None\nwith_cuda = False\n')
    run = subprocess.run([sys.executable, "-c", _FIRST_USES, str(pkg), str(tmp_path / "store")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 5, run.stdout
    for line in lines:
        assert "built against torch 1.13.1, but this is torch " + torch.__version__ in line, line
        assert "pip install --no-build-isolation --no-deps -e ." in line, line


def test_unbuilt_extension_says_how_to_build():
    err = ModuleNotFoundError("No module named 'torch_odc_backend._C'", name="torch_odc_backend._C")
    msg = _build_check.load_failure_message(err, None, "2.13.0")
    assert "not built" in msg and "pip install --no-build-isolation --no-deps -e ." in msg


# --- pyproject.toml ----------------------------------------------------------------------

def test_pyproject_build_system():
    build = _pyproject()["build-system"]
    assert build["build-backend"] == "setuptools.build_meta"
    req = _names(build["requires"])
    assert {"setuptools", "wheel", "pybind11", "torch"} <= set(req)
    assert ">=77" in req["setuptools"]  # PEP 660 editable installs, PEP 639 license metadata
    assert ">=2.11" in req["torch"]


def test_pyproject_metadata_and_extras():
    project = _pyproject()["project"]
    assert project["name"] == "torch_odc_backend"
    assert project["readme"] == "README.md" and (ROOT / "README.md").exists()
    assert project["requires-python"] == ">=3.10"
    assert "version" in project or "version" in project.get("dynamic", [])
    # the torch requirement is the build's own release (setup.py; tests/test_metadata.py)
    assert "dependencies" in project.get("dynamic", []) and "dependencies" not in project
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    extras = {k: _names(v) for k, v in project["optional-dependencies"].items()}
    assert {"pytest", "numpy", "matplotlib"} <= set(extras["test"])
    assert ">=3.4" in extras["nvshmem"]["nvidia-nvshmem-cu13"]
    assert _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"][0] == "torch_odc_backend"


def test_setup_py_describes_only_the_extension():
    tree = ast.parse((ROOT / "setup.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup"]
    assert len(calls) == 1
    assert {k.arg for k in calls[0].keywords} == {"ext_modules", "cmdclass", "install_requires"}


def test_runtime_imports_are_declared():
    # numpy: imported lazily by odc.balance.FittedCost.fit only (in the test extra)
    imports = _third_party_imports((ROOT / "torch_odc_backend").rglob("*.py"))
    # _torch_odc_backend_autoload: this distribution's own entry-point module; verl: only
    # torch_odc_backend.verl, odc's engines for verl (the verl extra)
    assert imports <= {"torch", "numpy", "_torch_odc_backend_autoload", "verl"}, imports
    outside = _third_party_imports(p for p in (ROOT / "torch_odc_backend").rglob("*.py") if "verl" not in p.parts)
    assert "verl" not in outside, outside
    assert "verl" in _names(_pyproject()["project"]["optional-dependencies"]["verl"])
    assert _third_party_imports([ROOT / "_torch_odc_backend_autoload.py"]) <= {"torch"}


def test_autoload_entry_point_is_declared_and_installed():
    from importlib.metadata import entry_points

    declared = _pyproject()["project"]["entry-points"]["torch.backends"]
    assert declared == {"odc": "_torch_odc_backend_autoload:autoload"}, declared
    assert "_torch_odc_backend_autoload" in _pyproject()["tool"]["setuptools"]["py-modules"]
    installed = {e.name: e.value for e in entry_points(group="torch.backends")}
    assert installed.get("odc") == declared["odc"], installed


def test_benchmark_imports_are_in_the_benchmarks_extra():
    dist_of = {"cuda": "cuda-bindings", "PIL": "pillow"}  # module -> distribution where the names differ
    imports = _third_party_imports((ROOT / "benchmarks").glob("*.py")) - {"torch"}
    extra = set(_names(_pyproject()["project"]["optional-dependencies"]["benchmarks"]))
    assert {dist_of.get(m, m) for m in imports} <= extra, imports
