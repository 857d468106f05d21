#!/usr/bin/env python3
"""Make ``ODC_DEFAULT_BACKEND`` work for a source checkout that is not installed.

The switch acts at ``import torch``, through torch_odc_backend's ``torch.backends`` entry
point, which installing the package records (``pip install --no-build-isolation -e .``).
A checkout used through ``PYTHONPATH`` (e.g. after ``setup.py build_ext --inplace``) has
no such record, and then the switch silently does nothing: the trainer gets NCCL/gloo.

``python examples/recipes/odc_entry_point.py FOLDER`` prints nothing and writes nothing
when the entry point is installed; otherwise it writes the record an install would make
(the distribution's METADATA and entry_points.txt, nothing else) under FOLDER and prints
FOLDER, to be put on the ranks' PYTHONPATH next to the checkout.
"""
from __future__ import annotations

import importlib.metadata as md
import sys
from pathlib import Path

ENTRY_POINT = "odc = _torch_odc_backend_autoload:autoload"


def installed() -> bool:
    return any(e.name == "odc" for e in md.entry_points(group="torch.backends"))


def ensure(folder) -> Path | None:
    """None where the entry point is installed; else the folder now holding its record."""
    if installed():
        return None
    folder = Path(folder).resolve()
    info = folder / "torch_odc_backend-0.0.0+source.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_odc_backend\nVersion: 0.0.0+source\n")
    (info / "entry_points.txt").write_text(f"[torch.backends]\n{ENTRY_POINT}\n")
    return folder


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    found = ensure(sys.argv[1])
    if found:
        print(found)
