"""setup.py: CUDA kernels only when a GPU is visible (or PPO_FAST_BUILD_CUDA=1), a fast C++ build."""

from __future__ import annotations

import os
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup_py() -> dict:
    """setup.py's functions (run under another name: it decides, but calls setup() only as __main__)."""
    return runpy.run_path(str(ROOT / "setup.py"), run_name="ppo_fast_setup_under_test")


@pytest.mark.parametrize(
    "mode, gpu, torch_cuda, cuda_home, build, why",
    [
        ("auto", None, True, "/usr/local/cuda", False, "no GPU visible"),
        ("auto", "nvidia-smi -L", True, "/usr/local/cuda", True, "GPU visible (nvidia-smi -L)"),
        ("auto", "/dev/nvidia0", False, "/usr/local/cuda", False, "torch is a CPU-only build"),
        ("auto", "/dev/nvidia0", True, None, False, "no CUDA toolkit (nvcc) found"),
        ("1", None, True, "/usr/local/cuda", True, "PPO_FAST_BUILD_CUDA=1"),
        ("0", "/dev/nvidia0", True, "/usr/local/cuda", False, "PPO_FAST_BUILD_CUDA=0"),
    ],
)
def test_cuda_kernels_only_when_a_gpu_is_visible_or_asked_for(setup_py, mode, gpu, torch_cuda, cuda_home, build, why):
    planned, reason = setup_py["cuda_plan"](mode, gpu, torch_cuda, cuda_home)
    assert planned is build and why in reason


def test_a_gpu_is_seen_through_nvidia_smi(setup_py, tmp_path, monkeypatch):
    visible = setup_py["_visible_gpu"]
    smi = tmp_path / "nvidia-smi"
    monkeypatch.setattr("glob.glob", lambda pattern: [])  # no /dev/nvidia<N> here
    monkeypatch.setenv("PATH", str(tmp_path))
    assert visible() is None  # no nvidia-smi at all
    smi.write_text("#!/bin/sh\necho 'GPU 0: Fake GPU (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    assert visible() == "nvidia-smi -L"
    smi.write_text("#!/bin/sh\necho 'No devices were found'; exit 6\n")
    assert visible() is None


@pytest.mark.parametrize(
    "env, visible, nvcc, archs",
    [
        ("7.5;8.6", ["9.0"], ["8.0", "9.0"], "7.5;8.6"),  # the user's list wins
        ("", [], ["8.0", "9.0", "10.0", "12.0"], "8.0;9.0;10.0+PTX"),  # no GPU: A100, H100/H200, B200 + PTX
        ("", ["9.0", "9.0"], ["9.0", "10.0"], "9.0+PTX"),
        ("", ["12.0", "8.6"], ["8.6", "12.0", "12.1"], "8.6;12.0+PTX"),
        ("", ["12.0"], ["8.0", "9.0", "10.0"], "10.0+PTX"),  # newer than nvcc: its newest PTX, JIT-compiled
        ("", ["7.0", "9.0"], ["7.5", "9.0"], "9.0+PTX"),  # older than nvcc: left out, not a failed build
        ("", ["7.0", "[N/A]"], ["7.5", "9.0"], "8.0;9.0;10.0+PTX"),
    ],
)
def test_cuda_architectures_cover_the_gpus_the_build_may_meet(setup_py, env, visible, nvcc, archs):
    # A build for 8.0 and 9.0 alone has no code a B200 (10.0) or an RTX 50xx (12.0) can run.
    assert setup_py["cuda_arch_list"](env, visible, nvcc)[0] == archs


def test_the_architectures_become_one_token_for_the_compiler_command_line(setup_py):
    token = setup_py["arch_token"]
    assert token("8.0;9.0;10.0+PTX") == "80_90_100_PTX"  # no ';' for the shell that runs ninja's commands
    assert token("8.0 9.0a") == "80_90a" and token("") == "none"


def test_build_flags_drop_debug_info_and_use_a_precompiled_header(setup_py):
    assert "-g0" in setup_py["cxx_flags"] and "-O3" in setup_py["cxx_flags"]
    assert "ATen/ATen.h" in setup_py["PCH_HEADERS"] and "torch/library.h" in setup_py["PCH_HEADERS"]


def test_a_cpu_level_alone_is_asked_for_by_name(setup_py):
    macros = setup_py["cpu_clone_macros"]
    assert macros("") == [] and macros("default") == [("PPO_FAST_CPU_CLONE_BASELINE", None)]
    assert macros("x86-64-v3") == [("PPO_FAST_CPU_CLONE_V3", None)]
    with pytest.raises(SystemExit, match="PPO_FAST_CPU_CLONE must be one of .*got 'avx2'"):
        macros("avx2")


def test_ninja_is_found_in_a_venv_that_is_not_activated(setup_py, tmp_path):
    # `.venv/bin/pip install ninja` then `.venv/bin/pip install -e .`: ninja is not on PATH, and
    # without it torch compiles one unit at a time (seen on a clean Debian, where no ninja was).
    venv_bin, other = tmp_path / "bin", tmp_path / "other"
    venv_bin.mkdir(), other.mkdir()
    (venv_bin / "ninja").write_text("#!/bin/sh\n")
    (venv_bin / "ninja").chmod(0o755)
    found = setup_py["path_with_ninja"]
    assert found(str(other), [None, str(other), str(venv_bin)]) == f"{venv_bin}{os.pathsep}{other}"
    assert found(str(venv_bin), [str(other)]) == str(venv_bin)  # on PATH already: unchanged
    assert found(str(other), [str(other)]) == str(other)  # nowhere: torch's own fallback, unchanged


def test_an_editable_install_again_compiles_only_what_changed(setup_py, tmp_path, monkeypatch):
    # `pip install -e '.[lora]'` after `-e '.[train]'`: the objects stay in the checkout's build/
    # (setuptools' own temp folder, shared with `setup.py build_ext`), not in a fresh temporary
    # folder, and the torch headers are precompiled again only when a flag or torch changed.
    assert setup_py["editable_build_temp"]("/repo", "linux-x86_64").startswith("/repo/build/temp.linux-x86_64-")
    precompile = setup_py["_precompile"]
    compiled = []

    def fake_run(command, **_):
        compiled.append(command)
        Path(command[command.index("-o") + 1]).write_text("gch")
        return type("Done", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr(precompile.__globals__["subprocess"], "run", fake_run)
    header = precompile("c++", ["-O3"], ["-std=c++20"], str(tmp_path))
    assert header == str(tmp_path / "ppo_fast_pch.h") and len(compiled) == 1
    assert precompile("c++", ["-O3"], ["-std=c++20"], str(tmp_path)) == header and len(compiled) == 1
    assert precompile("c++", ["-O1"], ["-std=c++20"], str(tmp_path)) == header and len(compiled) == 2
