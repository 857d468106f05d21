"""Every ODC_* variable the project reads is documented in docs/configuration.md, and the
runtime table there lists exactly the knobs config.py parses plus the process-wide ones (read
at import and exit: ODC_DEFAULT_BACKEND, ODC_ALLOW_LAZY_LOADING, ODC_STATS_DIR; by the verl
engine: ODC_VERL_ROLES, ODC_VERL_BALANCE)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "configuration.md").read_text()
PROCESS_WIDE = {"ODC_DEFAULT_BACKEND", "ODC_ALLOW_LAZY_LOADING", "ODC_STATS_DIR", "ODC_VERL_ROLES",
                "ODC_VERL_BALANCE", "ODC_FSDP_REGISTERED_MEMORY"}


def _section(title: str) -> str:
    start = DOC.index(f"## {title}")
    end = DOC.find("\n## ", start + 1)
    return DOC[start:end if end > 0 else None]


def _table_names(text: str) -> set[str]:
    return set(re.findall(r"^\| `(ODC_[A-Z_]+)`", text, flags=re.M))


def test_runtime_table_is_the_knob_table():
    from torch_odc_backend import config

    parsed = {k.env for k in config.KNOBS}
    assert _table_names(_section("Runtime")) == parsed | PROCESS_WIDE


def test_every_variable_read_is_documented():
    read = set()
    files = [ROOT / "setup.py", ROOT / "_torch_odc_backend_autoload.py", *ROOT.glob("torch_odc_backend/**/*.py"),
             *ROOT.glob("benchmarks/*.py"), *ROOT.glob("benchmarks/*.sh"), *ROOT.glob("examples/**/*.py"),
             *ROOT.glob("examples/*.sh"), *ROOT.glob("tests/**/*.py")]
    for f in files:
        read |= set(re.findall(r"\b(ODC_[A-Z][A-Z_]+)\b", f.read_text()))
    read -= {"ODC_CHECK", "ODC_WITH_CUDA"}  # C++ macros (error check; the CUDA build) named in Python
    documented = set(re.findall(r"`(ODC_[A-Z_]+)", DOC))
    assert read <= documented, f"read but not in docs/configuration.md: {sorted(read - documented)}"
