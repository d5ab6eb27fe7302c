"""Build of the C++/CUDA extension ``ppo_fast._C``.

* One home per op: ``csrc/<op>.cpp`` (its schemas, C++ CPU kernel and CPU registration) and
  ``csrc/autograd/<op>.cpp`` (its autograd kernels, every device), with ``csrc/module.cpp`` and the
  shared headers of ``csrc/common/``, are always built.
* CUDA kernels (``csrc/cuda/<op>.cu`` + their torch glue ``csrc/cuda/<op>.cpp``), by ``PPO_FAST_BUILD_CUDA``:
  ``auto`` (default) builds them when a GPU is visible (``nvidia-smi -L`` lists one,
  or a ``/dev/nvidia<N>`` device exists), torch is a CUDA build and nvcc is found;
  ``1`` always (no GPU needed; fails loudly if torch or nvcc cannot); ``0`` never.
  Skipping them on a machine without a GPU saves most of the build time.
* Architectures (``cuda_arch_list``): ``TORCH_CUDA_ARCH_LIST`` if set; else the visible GPUs'
  (``nvidia-smi``), PTX for the newest; with none visible, sm_80, sm_90 and sm_100 with PTX
  for the GPUs after them.  ``ppo_fast._C.cuda_archs()`` says what a build holds.
* Compiled without debug information (``-g0``, a third less compile time than
  Python's default ``-g``), in parallel (ninja, also from the venv's bin when the venv
  is not activated; ``MAX_JOBS`` caps the jobs), with GCC from a precompiled header of
  the torch headers every unit includes (``PPO_FAST_PCH=0`` turns it off).
* ``PPO_FAST_SANITIZE=address,undefined`` (opt-in, for CI's sanitizer step,
  ``.ci/sanitize.sh``): the CPU kernels with AddressSanitizer and/or UBSan
  (``-fsanitize=...``, UBSan with float-cast-overflow; ``-fno-sanitize-recover=all``: a
  UBSan report aborts), at ``-O1`` with line tables (``-g1``) and frame pointers for
  readable traces; CPU kernels only, no precompiled header.  Python loads it only with
  the ASan runtime preloaded (LD_PRELOAD; see that script).
"""

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig

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
        if os.path.exists(os.path.join(root, "bin", "nvcc")) and os.path.exists(
            os.path.join(root, "include", "cuda_runtime.h")
        ):
            return root
    return None


def _visible_gpu():
    """How a GPU was seen (``nvidia-smi -L`` or a device node), or None.  Cheap: no torch."""
    nodes = sorted(glob.glob("/dev/nvidia[0-9]*"))
    if nodes:
        return nodes[0]
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        if out.returncode == 0 and "GPU" in out.stdout:
            return "nvidia-smi -L"
    return None


def cuda_plan(mode: str, gpu, torch_has_cuda: bool, cuda_home) -> tuple[bool, str]:
    """(build the CUDA kernels?, why) for ``PPO_FAST_BUILD_CUDA=mode``."""
    if mode == "0":
        return False, "PPO_FAST_BUILD_CUDA=0"
    if mode == "1":
        return True, "PPO_FAST_BUILD_CUDA=1"
    if gpu is None:
        return False, "no GPU visible (nvidia-smi -L, /dev/nvidia*); PPO_FAST_BUILD_CUDA=1 builds them anyway"
    if not torch_has_cuda:
        return False, "torch is a CPU-only build"
    if cuda_home is None:
        return False, "GPU visible but no CUDA toolkit (nvcc) found; set CUDA_HOME"
    return True, f"GPU visible ({gpu})"


# With no GPU to ask (a login node, CI): A100 (8.0), H100/H200 (9.0), B200/GB200 (10.0), and
# compute_100 PTX, which the driver compiles for any newer GPU (RTX 50xx, ...).
DEFAULT_CUDA_ARCHS = "8.0;9.0;10.0+PTX"


def _visible_capabilities() -> list:
    """The visible GPUs' compute capabilities as nvidia-smi prints them ("9.0"), [] if it cannot."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def _nvcc_archs(cuda_home) -> list:
    """The compute capabilities nvcc compiles for ("8.0", ...), [] if it does not say."""
    try:
        out = subprocess.run(
            [os.path.join(cuda_home, "bin", "nvcc"), "--list-gpu-arch"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return []
    archs = [w.removeprefix("compute_") for w in out.stdout.split() if w.startswith("compute_")]
    return [f"{a[:-1]}.{a[-1]}" for a in archs if a.isdigit()]


def _arch_key(arch: str) -> tuple:
    major, minor = arch.split(".")
    return int(major), int(minor)


def cuda_arch_list(env_value: str, capabilities, nvcc_archs) -> tuple[str, str]:
    """(TORCH_CUDA_ARCH_LIST for the build, why).  A build for 8.0 and 9.0 alone has no code a
    GPU of capability 10.0 or 12.0 can run: its kernels would fail there at launch."""
    if env_value:
        return env_value, "TORCH_CUDA_ARCH_LIST"
    caps = sorted({c for c in capabilities if re.fullmatch(r"\d+\.\d", c)}, key=_arch_key)
    if not caps:
        return DEFAULT_CUDA_ARCHS, "no GPU to ask"
    why = "the visible GPUs"
    if nvcc_archs:
        oldest, newest = min(nvcc_archs, key=_arch_key), max(nvcc_archs, key=_arch_key)
        if _arch_key(caps[0]) < _arch_key(oldest):  # nvcc would refuse the whole build
            caps = [c for c in caps if _arch_key(c) >= _arch_key(oldest)]
            if not caps:
                return DEFAULT_CUDA_ARCHS, f"the visible GPUs are older than this nvcc's oldest, {oldest}"
            why += f", from {oldest} (this nvcc's oldest)"
        if _arch_key(caps[-1]) > _arch_key(newest):  # the driver compiles nvcc's newest PTX for it
            caps = sorted({c for c in caps if _arch_key(c) <= _arch_key(newest)} | {newest}, key=_arch_key)
            why += f", up to {newest} (this nvcc's newest)"
    return ";".join(caps[:-1] + [caps[-1] + "+PTX"]), why


def arch_token(archs: str) -> str:
    """TORCH_CUDA_ARCH_LIST as one preprocessor token for the build's command lines, which a
    shell reads ("8.0;9.0;10.0+PTX" -> 80_90_100_PTX; ``ppo_fast._C.cuda_archs()`` returns it)."""
    entries = archs.replace(";", " ").replace("+", " ").split()
    return "_".join("".join(ch for ch in entry if ch.isalnum()) for entry in entries) or "none"


def path_with_ninja(path: str, folders) -> str:
    """PATH, with the first of folders that holds ninja put first when PATH finds none:
    `.venv/bin/pip install ninja` puts ninja in the venv's bin, which is on PATH only in an
    activated venv, and without ninja torch compiles one unit at a time, with no precompiled
    header."""
    if shutil.which("ninja", path=path):
        return path
    for folder in folders:
        if folder and shutil.which("ninja", path=folder):
            return folder + os.pathsep + path if path else folder
    return path


def _ninja_folders() -> list:
    """Where this interpreter's ninja may be: its scripts folder, or the ninja package's."""
    folders = [sysconfig.get_path("scripts"), os.path.dirname(sys.executable)]
    try:
        import ninja

        folders.append(getattr(ninja, "BIN_DIR", None))
    except ImportError:
        pass
    return folders


SANITIZERS = ("address", "undefined")
# Each x86-64 level of the CPU kernels' hot loops and the macro that builds it alone (csrc/common/fast_exp.h).
CPU_CLONES = {
    "x86-64-v4": "PPO_FAST_CPU_CLONE_V4",
    "x86-64-v3": "PPO_FAST_CPU_CLONE_V3",
    "default": "PPO_FAST_CPU_CLONE_BASELINE",
}


def cpu_clone_macros(value: str) -> list:
    """The macros that ``PPO_FAST_CPU_CLONE=value`` asks for: the CPU kernels' hot loops are
    compiled for every level in CPU_CLONES and the loader runs the widest the CPU has; a test
    build names one level, so that a machine with AVX-512 also runs the others' code ([] when
    unset or empty: all of them)."""
    value = value.strip().lower()
    if not value:
        return []
    if value not in CPU_CLONES:
        sys.exit(f"PPO_FAST_CPU_CLONE must be one of {', '.join(CPU_CLONES)} (or unset), got {value!r}")
    return [(CPU_CLONES[value], None)]


def sanitize_plan(value: str) -> list:
    """The sanitizers ``PPO_FAST_SANITIZE=value`` asks for ([] when unset, empty or 0)."""
    value = value.strip().lower()
    if value in ("", "0"):
        return []
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in SANITIZERS]
    if unknown or not names:
        sys.exit(f"PPO_FAST_SANITIZE must be a comma-separated list of {', '.join(SANITIZERS)}, got {value!r}")
    return list(dict.fromkeys(names))


sanitizers = sanitize_plan(os.environ.get("PPO_FAST_SANITIZE", ""))
mode = os.environ.get("PPO_FAST_BUILD_CUDA", "auto").lower()
if mode not in ("auto", "0", "1"):
    sys.exit(f"PPO_FAST_BUILD_CUDA must be auto, 0 or 1, got {mode!r}")
if sanitizers:  # a sanitized build is of the CPU kernels only (CI exports PPO_FAST_BUILD_CUDA=1)
    mode = "0"
gpu = _visible_gpu() if mode == "auto" else None
cuda_home = _find_cuda_home() if mode == "1" or gpu else None
if cuda_home:
    os.environ["CUDA_HOME"] = cuda_home  # read by torch.utils.cpp_extension at import

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

torch_has_cuda = torch.version.cuda is not None
build_cuda, why = cuda_plan(mode, gpu, torch_has_cuda, cuda_home)
if sanitizers:
    why = f"PPO_FAST_SANITIZE={','.join(sanitizers)}: CPU kernels only"
if build_cuda and not (torch_has_cuda and cuda_home):
    sys.exit(
        "PPO_FAST_BUILD_CUDA=1 but CUDA kernels cannot be built: "
        + ("torch is a CPU-only build" if not torch_has_cuda else "no CUDA toolkit (nvcc) found; set CUDA_HOME")
    )

here = os.path.dirname(os.path.abspath(__file__))
cpp_sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/autograd/*.cpp"))
# -fno-trapping-math lets GCC if-convert (and so vectorize) the selects in the CPU kernels.
# -g0 overrides the -g in Python's CFLAGS: debug information for torch's headers costs a
# third of the compile time.  GCC contracts a * b + c into FMAs (its default for C++): the
# kernels that must round a product as their backward does store it first (token_logprobs.cpp).
cxx_flags = ["-O3", "-g0", "-std=c++20", "-fno-trapping-math"]
if sys.platform != "win32":
    cxx_flags += ["-fopenmp"]
link_flags = ["-fopenmp"]
define_macros = cpu_clone_macros(os.environ.get("PPO_FAST_CPU_CLONE", ""))
if sanitizers:
    # GCC's -fsanitize=undefined leaves out float-cast-overflow (a float out of an
    # integer's range, NaN included, converted to it: undefined behaviour); ask for it.
    checks = [*sanitizers, "float-cast-overflow"] if "undefined" in sanitizers else sanitizers
    # -O1 and line tables: readable traces at a fraction of -O3 -g's compile time.
    san = ["-fsanitize=" + ",".join(checks), "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
    cxx_flags = [f for f in cxx_flags if f not in ("-O3", "-g0")] + ["-O1", "-g1", *san]
    link_flags += san

if build_cuda:
    archs, archs_why = cuda_arch_list(
        os.environ.get("TORCH_CUDA_ARCH_LIST", ""), _visible_capabilities(), _nvcc_archs(cuda_home)
    )
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    why += f"; architectures {archs} ({archs_why})"
    define_macros.append(("PPO_FAST_CUDA_ARCHS", arch_token(archs)))
    sources = cpp_sources + sorted(glob.glob("csrc/cuda/*.cpp") + glob.glob("csrc/cuda/*.cu"))
    define_macros.append(("PPO_FAST_WITH_CUDA", None))
    extension = CUDAExtension(
        "ppo_fast._C",
        sources,
        include_dirs=[os.path.join(here, "csrc")],
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++20", "--use_fast_math", "-lineinfo"]},
        extra_link_args=link_flags,
    )
else:
    extension = CppExtension(
        "ppo_fast._C",
        cpp_sources,
        include_dirs=[os.path.join(here, "csrc")],
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
    )

# Every C++ translation unit parses the same torch headers (ATen.h, torch/library.h):
# about two thirds of its compile time.  With GCC they are parsed once, into a
# precompiled header that each unit includes first (-include); GCC falls back to the
# plain header if the PCH does not fit (same result, slower).  PPO_FAST_PCH=0 turns it off.
PCH_HEADERS = ("ATen/ATen.h", "ATen/Dispatch.h", "ATen/Parallel.h", "torch/library.h")


def _is_gcc(cxx: str) -> bool:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "Free Software Foundation" in out and "clang" not in out.lower()


def _precompile(cxx: str, cflags: list, post: list, build_dir: str):
    """The torch headers precompiled into ``build_dir`` with the units' flags: the header's path,
    or None if compiling it failed.  Done again only when the compiler, its flags or torch changed."""
    import time

    header = os.path.join(build_dir, "ppo_fast_pch.h")
    text = "".join(f"#include <{h}>\n" for h in PCH_HEADERS)
    key = "\n".join([text, cxx, *cflags, *post, torch.__version__, os.path.dirname(torch.__file__)])
    stamp = header + ".key"
    if os.path.exists(header + ".gch") and os.path.exists(stamp) and open(stamp).read() == key:
        print("ppo_fast: the precompiled torch headers are current")
        return header
    os.makedirs(build_dir, exist_ok=True)
    if os.path.exists(stamp):
        os.remove(stamp)
    with open(header, "w") as f:
        f.write(text)
    start = time.perf_counter()
    result = subprocess.run(
        [cxx, *cflags, "-x", "c++-header", header, "-o", header + ".gch", *post], capture_output=True, text=True
    )
    if result.returncode != 0:
        print("ppo_fast: no precompiled header (compiling it failed), building without:\n" + result.stderr[-2000:])
        return None
    print(f"ppo_fast: precompiled the torch headers in {time.perf_counter() - start:.0f} s")
    with open(stamp, "w") as f:
        f.write(key)
    return header


def _with_pch(compile_objects):
    """Wrap torch's ninja compile step: build the PCH with the units' own flags, then add it."""

    def compile_with_pch(*args, **kwargs):
        if not {"build_directory", "cflags", "post_cflags"} <= kwargs.keys():  # another torch: leave it alone
            return compile_objects(*args, **kwargs)
        import shlex

        cxx = os.environ.get("CXX", "c++")  # the compiler torch's ninja file uses
        cflags = shlex.split(" ".join(kwargs["cflags"]))
        post = shlex.split(" ".join(kwargs["post_cflags"]))
        header = _precompile(cxx, cflags, post, kwargs["build_directory"])
        if header is not None:
            kwargs["post_cflags"] = list(kwargs["post_cflags"]) + ["-Winvalid-pch", "-include", shlex.quote(header)]
        return compile_objects(*args, **kwargs)

    return compile_with_pch


def _distinct_cuda_objects(compiler) -> None:
    """csrc/cuda/<op>.cu and its torch glue csrc/cuda/<op>.cpp share a base name: a .cu's
    object keeps the suffix (<op>.cu.o) so that the two objects do not collide."""
    original = compiler.object_filenames

    def object_filenames(source_filenames, strip_dir=False, output_dir=""):
        objects = original(source_filenames, strip_dir=strip_dir, output_dir=output_dir)
        ext = compiler.obj_extension
        return [
            obj[: -len(ext)] + ".cu" + ext if src.endswith(".cu") else obj
            for src, obj in zip(source_filenames, objects)
        ]

    compiler.object_filenames = object_filenames


def editable_build_temp(root: str, plat_name: str) -> str:
    """Where an editable install (``pip install -e``) keeps the objects: a folder of the checkout
    (setuptools' own ``build/temp.<platform>-<python>``) instead of a fresh temporary one, so that
    installing again (another extra, ``-e '.[lora]'`` after ``-e '.[train]'``) recompiles only what
    changed: ninja compares each object with its sources, headers and command line."""
    return os.path.join(root, "build", f"temp.{plat_name}-{sys.implementation.cache_tag}")


class _BuildExt(BuildExtension):
    def finalize_options(self) -> None:
        super().finalize_options()
        if getattr(self, "editable_mode", False):
            self.build_temp = editable_build_temp(here, self.plat_name)

    def build_extensions(self) -> None:
        import torch.utils.cpp_extension as cpp_extension

        if build_cuda:
            _distinct_cuda_objects(self.compiler)

        original = getattr(cpp_extension, "_write_ninja_file_and_compile_objects", None)
        use_pch = (
            original is not None
            and os.environ.get("PPO_FAST_PCH", "1") != "0"
            and not sanitizers
            and sys.platform.startswith("linux")
            and _is_gcc(os.environ.get("CXX", "c++"))
        )
        if use_pch:
            cpp_extension._write_ninja_file_and_compile_objects = _with_pch(original)
        try:
            super().build_extensions()
        finally:
            if use_pch:
                cpp_extension._write_ninja_file_and_compile_objects = original


if __name__ == "__main__":  # as pip's build backend and `python setup.py` run it (tests import it)
    os.environ["PATH"] = path_with_ninja(os.environ.get("PATH", ""), _ninja_folders())
    print(f"ppo_fast: building the extension with CUDA kernels: {build_cuda} ({why}; CUDA_HOME={cuda_home})")
    setup(ext_modules=[extension], cmdclass={"build_ext": _BuildExt.with_options(use_ninja=True)})
