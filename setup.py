"""Build torch_odc_backend._C: CPU-only against a CPU torch, CPU + CUDA where torch has CUDA.

ODC_BUILD_CUDA=0 forces a CPU-only build; TORCH_CUDA_ARCH_LIST picks GPU
architectures (default 9.0, Hopper).
"""
import os

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

HOST_SOURCES = [
    "csrc/protocol.cpp",
    "csrc/transport.cpp",
    "csrc/transport_shm.cpp",
    "csrc/backend.cpp",
    "csrc/bindings.cpp",
]
CUDA_SOURCES = ["csrc/transport_cuda_ipc.cpp", "csrc/kernels.cu"]

with_cuda = (
    torch.version.cuda is not None
    and CUDA_HOME is not None
    and os.environ.get("ODC_BUILD_CUDA", "1") != "0"
)

cxx_flags = ["-O3", "-Wall", "-Wno-unused-parameter"]  # torch picks the C++ standard
if with_cuda:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    ext = CUDAExtension(
        "torch_odc_backend._C",
        HOST_SOURCES + CUDA_SOURCES,
        define_macros=[("ODC_WITH_CUDA", None)],
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
        libraries=["rt"],
    )
else:
    ext = CppExtension(
        "torch_odc_backend._C", HOST_SOURCES, extra_compile_args=cxx_flags, libraries=["rt"]
    )

setup(
    name="torch_odc_backend",
    version="0.1.0",
    description="One-sided (on-demand) all-gather / reduce-scatter process-group backend for FSDP",
    packages=find_packages(include=["torch_odc_backend", "torch_odc_backend.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
)
