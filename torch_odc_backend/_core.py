"""The compiled core ``_C``, loaded only after checking that it was built for the running torch:
every module that needs the core imports it from here (``from ._core import _C``), so a build
for another torch fails with an ImportError that says what to do, whichever use comes first."""
from __future__ import annotations

from . import _build_check

_build_check.check()  # ImportError naming both torch versions when _C was built against another torch
from . import _C  # noqa: E402, F401
