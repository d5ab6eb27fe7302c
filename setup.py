"""Build of the C++/CUDA extension ``ppo_fast._C``.

* C++ CPU kernels (``csrc/*.cpp``, ``csrc/cpu/*.cpp``) are always built.
* CUDA kernels (``csrc/cuda/*.cu`` + ``csrc/cuda/*.cpp``) are built when
  ``PPO_FAST_BUILD_CUDA`` is ``auto`` (default) and torch is a CUDA build and nvcc
  is found, or always with ``PPO_FAST_BUILD_CUDA=1`` (which fails loudly if it
  cannot); never with ``PPO_FAST_BUILD_CUDA=0``.  No GPU is needed to build.
* Architectures: ``TORCH_CUDA_ARCH_LIST`` if set, else sm_80 and sm_90.
"""

import glob
import os
import shutil
import sys

from setuptools import setup


def _find_cuda_home():
    """The real CUDA root.  ``nvcc`` on PATH may be a wrapper script in another folder,
    in which case torch's guess (the wrapper's parent) has no libcudart."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return os.environ.get("CUDA_HOME") or os.environ["CUDA_PATH"]
    nvcc = shutil.which("nvcc")
    candidates = []
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
        with open(nvcc, "rb") as f:  # a wrapper: look for the path it execs
            head = f.read(4096)
        if head.startswith(b"#!"):
            for token in head.decode(errors="ignore").split():
                if token.endswith("/bin/nvcc") and os.path.exists(token):
                    candidates.insert(0, os.path.dirname(os.path.dirname(token)))
    candidates += sorted(glob.glob("/usr/local/cuda*"), reverse=True)
    for root in candidates:
        if os.path.exists(os.path.join(root, "bin", "nvcc")) and os.path.exists(os.path.join(root, "include", "cuda_runtime.h")):
            return root
    return None


mode = os.environ.get("PPO_FAST_BUILD_CUDA", "auto").lower()
if mode not in ("auto", "0", "1"):
    sys.exit(f"PPO_FAST_BUILD_CUDA must be auto, 0 or 1, got {mode!r}")
cuda_home = _find_cuda_home() if mode != "0" else None
if cuda_home:
    os.environ["CUDA_HOME"] = cuda_home  # read by torch.utils.cpp_extension at import

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

torch_has_cuda = torch.version.cuda is not None
build_cuda = mode == "1" or (mode == "auto" and torch_has_cuda and cuda_home is not None)
if build_cuda and not (torch_has_cuda and cuda_home):
    sys.exit(
        "PPO_FAST_BUILD_CUDA=1 but CUDA kernels cannot be built: "
        + ("torch is a CPU-only build" if not torch_has_cuda else "no CUDA toolkit (nvcc) found; set CUDA_HOME")
    )

here = os.path.dirname(os.path.abspath(__file__))
cpp_sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
# -fno-trapping-math lets GCC if-convert (and so vectorize) the selects in the CPU kernels.
cxx_flags = ["-O3", "-std=c++20", "-fno-trapping-math"]
if sys.platform != "win32":
    cxx_flags += ["-fopenmp"]
define_macros = []

if build_cuda:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    sources = cpp_sources + sorted(glob.glob("csrc/cuda/*.cpp") + glob.glob("csrc/cuda/*.cu"))
    define_macros.append(("PPO_FAST_WITH_CUDA", None))
    extension = CUDAExtension(
        "ppo_fast._C",
        sources,
        include_dirs=[os.path.join(here, "csrc")],
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++20", "--use_fast_math", "-lineinfo"]},
        extra_link_args=["-fopenmp"],
    )
else:
    extension = CppExtension(
        "ppo_fast._C",
        cpp_sources,
        include_dirs=[os.path.join(here, "csrc")],
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=["-fopenmp"],
    )

print(f"ppo_fast: building the extension with CUDA kernels: {build_cuda} (CUDA_HOME={cuda_home})")
setup(ext_modules=[extension], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})
