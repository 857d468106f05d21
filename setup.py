"""Build torch_odc_backend._C: CPU-only against a CPU torch, CPU + CUDA where torch has CUDA.

The project's metadata is in pyproject.toml; this file only describes the extension.
Install with `pip install --no-build-isolation --no-deps -e .` (or `pip install
--no-build-isolation .`) in the environment whose torch the extension will run with.

ODC_BUILD_CUDA=0 forces a CPU-only build; TORCH_CUDA_ARCH_LIST picks GPU
architectures (default 9.0, Hopper). ODC_WITH_NVSHMEM=1 (CUDA builds) adds the NVSHMEM
runtime (host library only), found under $NVSHMEM_HOME or in the nvidia-nvshmem-cu13 wheel.
"""
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

HOST_SOURCES = [
    "csrc/protocol.cpp",
    "csrc/transport.cpp",
    "csrc/transport_shm.cpp",
    "csrc/backend.cpp",
    "csrc/bindings.cpp",
]
CUDA_SOURCES = ["csrc/transport_cuda_ipc.cpp", "csrc/kernels.cu"]

def nvshmem_dirs():
    """(include, lib) of NVSHMEM: $NVSHMEM_HOME, else the nvidia-nvshmem-cu13 wheel."""
    home = os.environ.get("NVSHMEM_HOME")
    if home:
        return os.path.join(home, "include"), os.path.join(home, "lib")
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except ModuleNotFoundError:
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = list(spec.submodule_search_locations)[0]
    return os.path.join(root, "include"), os.path.join(root, "lib")


with_cuda = (
    torch.version.cuda is not None
    and CUDA_HOME is not None
    and os.environ.get("ODC_BUILD_CUDA", "1") != "0"
)

cxx_flags = ["-O3", "-Wall", "-Wno-unused-parameter"]  # torch picks the C++ standard
if with_cuda:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    sources, macros, include_dirs, link_args = HOST_SOURCES + CUDA_SOURCES, [("ODC_WITH_CUDA", None)], [], []
    if os.environ.get("ODC_WITH_NVSHMEM", "0") == "1":
        dirs = nvshmem_dirs()
        if dirs is None or not os.path.exists(os.path.join(dirs[0], "nvshmem_host.h")):
            raise SystemExit("ODC_WITH_NVSHMEM=1: NVSHMEM not found; set NVSHMEM_HOME or "
                             "pip install nvidia-nvshmem-cu13")
        sources.append("csrc/nvshmem_runtime.cpp")
        macros.append(("ODC_WITH_NVSHMEM", None))
        include_dirs.append(dirs[0])
        # the wheel ships only the versioned name; rpath finds it without LD_LIBRARY_PATH
        link_args += [f"-L{dirs[1]}", "-l:libnvshmem_host.so.3", f"-Wl,-rpath,{dirs[1]}"]
    ext = CUDAExtension(
        "torch_odc_backend._C",
        sources,
        define_macros=macros,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
        extra_link_args=link_args,
        libraries=["rt"],
    )
else:
    ext = CppExtension(
        "torch_odc_backend._C", HOST_SOURCES, extra_compile_args=cxx_flags, libraries=["rt"]
    )

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})
