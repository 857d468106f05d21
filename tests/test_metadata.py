"""The installed distribution's metadata: its license, and the torch it requires being the
release its compiled core was built against (the only one it runs with)."""
from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

try:
    META = metadata.metadata("torch_odc_backend")
except metadata.PackageNotFoundError:
    META = None
needs_install = pytest.mark.skipif(META is None, reason="torch_odc_backend is not installed as a package: "
                                   "pip install --no-build-isolation --no-deps -e .")


@needs_install
def test_license_is_declared():
    assert META["License-Expression"] == "Apache-2.0", META.get_all("License-Expression")
    assert "LICENSE" in (META.get_all("License-File") or []), META.get_all("License-File")
    assert "Apache License" in (ROOT / "LICENSE").read_text()


@needs_install
def test_requires_the_torch_release_it_was_built_against():
    from torch_odc_backend import _build_info

    major, minor = (int(v) for v in _build_info.torch_version.split("+")[0].split(".")[:2])
    torch_reqs = [r for r in metadata.requires("torch_odc_backend") or [] if r.startswith("torch")
                  and "extra ==" not in r]
    assert len(torch_reqs) == 1, torch_reqs
    spec = set(torch_reqs[0][len("torch"):].replace(" ", "").split(","))
    assert spec == {f">={major}.{minor}", f"<{major}.{minor + 1}"}, torch_reqs
    running = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    assert running == (major, minor), (torch.__version__, _build_info.torch_version)
