#!/usr/bin/env bash
# Set up the project and train the example with FSDP2 over the "odc" backend:
#   bash examples/run.sh [train_fsdp2.py flags...]      e.g.  bash examples/run.sh --steps 50 --hsdp
# CPU: 2 processes ("cpu:odc"). GPUs: one process per visible GPU ("cpu:gloo,cuda:odc").
# It installs into the Python that runs it: PYTHON=/path/to/python, else python3 on the PATH
# (an active virtual environment's), and says which first; it refuses a distribution's own
# Python (PEP 668). ODC_SKIP_INSTALL=1 skips the install lines (already set up).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PYTHON:-$(command -v python3 || command -v python)}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
       NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}

if [ "${ODC_SKIP_INSTALL:-0}" != 1 ]; then
    # Where the packages go, said before anything is installed. A distribution's Python
    # (outside a virtual environment, an EXTERNALLY-MANAGED file in its standard library:
    # PEP 668) belongs to the system's package manager: refused, with the way out.
    "$PY" - <<'PYEOF' || exit 1
import os, sys, sysconfig
venv = sys.prefix != sys.base_prefix
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
if not venv and os.path.isfile(marker):
    sys.exit(f"examples/run.sh: {sys.executable} is the system's Python, managed by the distribution "
             f"({marker}); run.sh does not install into it. Make a virtual environment and run again:\n"
             "    python3 -m venv .venv && source .venv/bin/activate\n"
             "    bash examples/run.sh\n"
             "(Debian and Ubuntu: `apt install python3-venv` if venv is missing; "
             "ODC_SKIP_INSTALL=1 runs the example with this Python as it is, installing nothing.)")
kind = ("a virtual environment" if venv else "a conda environment"
        if os.environ.get("CONDA_PREFIX") == sys.prefix else
        "not a virtual environment: python3 -m venv .venv && source .venv/bin/activate makes one")
print(f"examples/run.sh: installing what is missing into {sys.prefix} (python {sys.executable}, {kind})",
      flush=True)
PYEOF
    # The install lines of .ci/run, except that a torch already present (e.g. a CUDA
    # build on a GPU machine) and packages already importable are left as they are.
    if "$PY" -c 'import torch' 2>/dev/null; then
        echo "using installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
    else
        "$PY" -m pip install torch==2.13.0
    fi
    missing=()
    for mod in wheel pybind11 ninja pytest numpy matplotlib; do
        "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod")
    done
    "$PY" -c 'import sys, setuptools; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' \
        2>/dev/null || missing+=("setuptools>=77")   # 77: SPDX license metadata (pyproject.toml)
    [ "${#missing[@]}" -eq 0 ] || "$PY" -m pip install "${missing[@]}"
    # --no-build-isolation: build against the torch above and fetch nothing (machines
    # without a package registry too). Skipped when this checkout is installed and its
    # compiled extension imports and is newer than every C++ source and build file.
    if "$PY" - <<'PYEOF'
import importlib.metadata, pathlib, sys
try:
    importlib.metadata.distribution("torch_odc_backend")
    import torch_odc_backend._C as ext
except Exception:
    sys.exit(1)
repo = pathlib.Path.cwd().resolve()
so = pathlib.Path(ext.__file__).resolve()
sources = [p for p in (repo / "csrc").rglob("*") if p.is_file()] + [repo / "setup.py", repo / "pyproject.toml"]
sys.exit(0 if so.parent == repo / "torch_odc_backend"
         and all(p.stat().st_mtime <= so.stat().st_mtime for p in sources) else 1)
PYEOF
    then
        echo "torch_odc_backend: installed from this checkout and built from its current sources"
    else
        MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install --no-build-isolation --no-deps -e .
    fi
fi

NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if [ "$NGPU" -gt 0 ]; then NPROC=$NGPU; else NPROC=2; fi
echo "launching $NPROC process(es) on $([ "$NGPU" -gt 0 ] && echo "$NGPU GPU(s)" || echo CPU) with $PY"
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node="$NPROC" examples/train_fsdp2.py "$@"
