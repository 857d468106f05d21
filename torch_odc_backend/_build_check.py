"""Is torch_odc_backend._C built for the torch that is running?

A torch C++ extension only works with the torch it was compiled against: libtorch's C++
ABI changes between minor releases, and a mismatch shows up as an undefined symbol on
import or as a crash later. It happens easily: an isolated build (plain `pip install .`)
compiles against whatever torch its build environment resolved, or torch was upgraded
after the build. setup.py records the torch it built against in ``_build_info.py``
(generated, beside ``_C``); ``check()`` compares that with the running torch before ``_C``
is loaded, and turns a failure to load ``_C`` into an ImportError that says what to do.
"""
from __future__ import annotations

import importlib
import warnings

import torch

REBUILD = (
    "Rebuild it in the environment that has the torch you run, from the source checkout: "
    "`pip install --no-build-isolation --no-deps -e .` (editable) or "
    "`pip install --no-build-isolation .`. Without --no-build-isolation pip builds against "
    "a torch of its own choosing."
)


def built_info() -> dict | None:
    """What setup.py recorded when it built _C, or None (no record: built before it was kept)."""
    try:
        from . import _build_info as b
    except ImportError:
        return None
    return {"torch_version": b.torch_version, "torch_cuda": b.torch_cuda, "with_cuda": b.with_cuda}


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def mismatch(built: dict, torch_version: str, torch_cuda: str | None) -> str | None:
    """Why an extension built as ``built`` (see built_info) cannot run with this torch, or None."""
    was = f"torch_odc_backend._C was built against torch {built['torch_version']}"
    if _major_minor(built["torch_version"]) != _major_minor(torch_version):
        return f"{was}, but this is torch {torch_version}. {REBUILD}"
    if built["with_cuda"]:
        if torch_cuda is None:
            return (f"{was} with CUDA {built['torch_cuda']}, but this torch ({torch_version}) "
                    f"has no CUDA. {REBUILD}")
        if str(built["torch_cuda"]).split(".")[0] != torch_cuda.split(".")[0]:
            return (f"{was} with CUDA {built['torch_cuda']}, but this torch ({torch_version}) "
                    f"has CUDA {torch_cuda}. {REBUILD}")
    return None


def load_failure_message(err: ImportError, built: dict | None, torch_version: str) -> str:
    """The message for an ImportError raised by loading _C."""
    if isinstance(err, ModuleNotFoundError) and err.name and err.name.endswith("._C"):
        return ("torch_odc_backend._C is not built (a source checkout without a build?). "
                "Build it in the environment that has the torch you run, from the source "
                "checkout: `pip install --no-build-isolation --no-deps -e .`.")
    if built is None:
        was = "no record of the torch it was built against (built before such records were kept)"
    else:
        was = f"it was built against torch {built['torch_version']}"
    return (f"torch_odc_backend._C failed to load with torch {torch_version} ({err}); {was}. "
            f"An undefined symbol usually means it was built against another torch. {REBUILD}")


def check() -> None:
    """Raise ImportError unless _C was built for the running torch, and load _C."""
    built = built_info()
    if built is not None:
        problem = mismatch(built, torch.__version__, torch.version.cuda)
        if problem:
            raise ImportError(problem)
        if built["torch_version"] != torch.__version__:
            warnings.warn(
                f"torch_odc_backend._C was built against torch {built['torch_version']}; this "
                f"is torch {torch.__version__} (same minor release, usually compatible). "
                f"{REBUILD}",
                RuntimeWarning,
                stacklevel=2,
            )
    try:
        importlib.import_module(f"{__package__}._C")
    except ImportError as e:
        raise ImportError(load_failure_message(e, built, torch.__version__)) from e
