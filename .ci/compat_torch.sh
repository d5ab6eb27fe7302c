#!/usr/bin/env bash
# Compatibility check against another torch + triton than the main venv's (torch 2.14.1):
#   2.11  torch 2.11 + triton 3.6, what the GPU machine we are lent has;
#   2.15  torch 2.15 + triton 3.9, the newest release on the index, what `pip install` gives a
#         user whose pip does not cap torch (pyproject asks torch>=2.11).
#
# Runs, in a venv of its own, what differs under another torch + triton: every test whose name
# contains "compile" (the sm_90 compile of every Triton kernel variant, torch.compile of every op), the
# custom-op registration of the native operators (opcheck), and a sample of the interpreter: the
# conformance matrix's Triton cells of the fast tier.  TRITON_INTERPRET=1 on CPU tensors; tests
# that need a GPU are deselected (-m "not cuda") or skip themselves; with COMPAT_CPU_CLONE, the
# native cells too.  The rest of the suite runs once, in the main venv (the README's command).
#
# The main venv's editable install keeps its extension (ppo_fast/_C*.so, built against the
# main torch) in the source tree, so this script never builds in the tree: it copies the
# working tree (tracked files + untracked, not ignored ones) into $COMPAT_VENV/src and makes
# the editable install and the test run there, with an extension built against that torch.
#
# Call from anywhere (cd's to the repo root):  bash .ci/compat_torch.sh 2.11|2.15
# Environment (all optional):
#   COMPAT_VENV        venv folder (default: <repo>/.venv211 or .venv215, git-ignored)
#   COMPAT_BUILD_CUDA  PPO_FAST_BUILD_CUDA for the build (default 0: CPU kernels only; "auto" also
#                      compiles the CUDA kernels against that torch, +4-6 min on 2 cores)
#   COMPAT_CPU_CLONE   PPO_FAST_CPU_CLONE for the build (x86-64-v3 or default): the C++ CPU kernels'
#                      hot loops for that x86-64 level only (a normal build has the AVX-512, AVX2
#                      and baseline levels, and an AVX-512 machine runs only the first); when set,
#                      the native cells of the fast tier run too (1,466 tests, ~70 s on 2 cores)
#   COMPAT_CXX         the C++ compiler for the CPU kernels (default: c++, GCC here), e.g. clang++-14
#                      (CC is set to the matching C compiler)
#   COMPAT_PYTHON      the venv's Python, as X.Y (default: python3, 3.11 here): pythonX.Y from PATH,
#                      else pyenv's (~/.pyenv/versions/X.Y.*), else python3 with a warning
#   COMPAT_PYTEST_ARGS extra pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export PYTHONUNBUFFERED=1

VERSION=${1:?usage: bash .ci/compat_torch.sh 2.11|2.15}
case "$VERSION" in
    2.11)
        TORCH_SPEC="torch==2.11.0" TRITON_PREFIX="3.6."
        NUMPY_SPEC="numpy<2.4"  # the triton 3.6 interpreter breaks with numpy 2.4
        ;;
    2.15)
        TORCH_SPEC="torch==2.15.0" TRITON_PREFIX="3.9." NUMPY_SPEC="numpy"
        # This machine's pip caps torch at 2.14.1 by a constraint file in its config
        # (/etc/xdg/pip); an empty constraint file replaces it for this venv's installs only.
        export PIP_CONSTRAINT=/dev/null
        ;;
    *) echo "compat: unknown torch version '$VERSION' (2.11 or 2.15)" >&2; exit 2 ;;
esac
VENV=${COMPAT_VENV:-$ROOT/.venv${VERSION/./}}
case "$VENV" in /*) ;; *) VENV=$ROOT/$VENV ;; esac
SRC=$VENV/src
PY=$VENV/bin/python

t0=$SECONDS
echo "== compat: torch $VERSION venv at $VENV"
find_python() {  # find_python X.Y: a working pythonX.Y, or nothing
    local want=$1 cand
    for cand in "$(command -v "python$want" || true)" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$want".*/bin/"python$want"; do
        [ -n "$cand" ] && [ -x "$cand" ] && "$cand" -c 'import venv' 2>/dev/null && { echo "$cand"; return; }
    done
}
BASE_PY=python3
if [ -n "${COMPAT_PYTHON:-}" ]; then
    BASE_PY=$(find_python "$COMPAT_PYTHON")
    if [ -z "$BASE_PY" ]; then
        echo "compat: WARNING: no Python $COMPAT_PYTHON on this machine (COMPAT_PYTHON; PATH, pyenv): the venv gets python3, $(python3 -V)" >&2
        BASE_PY=python3
    fi
fi
if [ ! -x "$PY" ]; then
    "$BASE_PY" -m venv "$VENV"
fi
"$PY" -m pip install -q "$TORCH_SPEC" "$NUMPY_SPEC" setuptools wheel ninja pybind11
"$PY" - "$VERSION." "$TRITON_PREFIX" <<'EOF'
import sys, numpy, torch, triton
print(f"compat: Python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, numpy {numpy.__version__}")
assert torch.__version__.startswith(sys.argv[1]), f"torch {torch.__version__}, want {sys.argv[1]}x"
assert triton.__version__.startswith(sys.argv[2]), f"triton {triton.__version__}, want {sys.argv[2]}x"
EOF
echo "compat: venv ready in $((SECONDS - t0)) s"

# A fresh copy of the working tree (never the venv itself, nor build outputs).
t1=$SECONDS
bash "$ROOT/.ci/copy_tree.sh" "$SRC" "$VENV"

build_env=(PPO_FAST_BUILD_CUDA="${COMPAT_BUILD_CUDA:-0}" PPO_FAST_CPU_CLONE="${COMPAT_CPU_CLONE:-}")
if [ -n "${COMPAT_CXX:-}" ]; then  # CC too: torch's build reads it (and hands it to nvcc as its host compiler)
    command -v "$COMPAT_CXX" >/dev/null || { echo "compat: no C++ compiler '$COMPAT_CXX' (COMPAT_CXX)" >&2; exit 2; }
    cc=${COMPAT_CXX/clang++/clang}  # clang++-14 -> clang-14, g++-12 -> gcc-12
    build_env+=(CXX="$COMPAT_CXX" CC="${cc/g++/gcc}")
fi
echo "== compat: building ppo_fast against torch $VERSION in $SRC with $("${COMPAT_CXX:-c++}" --version | head -1) (${build_env[*]})"
(cd "$SRC" && env "${build_env[@]}" "$PY" -m pip install -q --no-build-isolation -e '.[test]' "$TORCH_SPEC" "$NUMPY_SPEC")
(cd "$SRC" && "$PY" -c "import ppo_fast, ppo_fast._C as C; assert ppo_fast.__file__.startswith('$SRC'), ppo_fast.__file__; print('compat: ppo_fast from', ppo_fast.__file__, '| CUDA kernels:', C.built_with_cuda())")
echo "compat: build in $((SECONDS - t1)) s"

# The compile tests, the registration and the sampled interpreter cells, in one run, from the copy
# (the sm_90 report of this triton is not the one `bench static` prints: not written for it).
SELECT="compile or opcheck or native_operator or (test_backend_matches_reference and triton)"
[ -z "${COMPAT_CPU_CLONE:-}" ] || SELECT="$SELECT or native"
echo "== compat: pytest (TRITON_INTERPRET=1): -k '$SELECT' -m 'not cuda'"
t2=$SECONDS
rc=0
# PPO_FAST_STATIC_EVERY=1: the sm_90 compile of every Triton variant with its budgets (the fast tier samples
# them): another Triton's registers and spills differ variant by variant.
(cd "$SRC" && env -u PPO_FAST_STATIC_REPORT TRITON_INTERPRET=1 PPO_FAST_STATIC_EVERY=1 "$PY" -m pytest tests -p no:cacheprovider -q -rfE \
    --tb=short --log-level=WARNING -W ignore::DeprecationWarning -k "$SELECT" -m "not cuda" ${COMPAT_PYTEST_ARGS:-}) || rc=$?
echo "compat: pytest in $((SECONDS - t2)) s, total $((SECONDS - t0)) s, exit status $rc"
if [ "$rc" -ne 0 ]; then
    echo "compat: FAILED against $TORCH_SPEC + triton $TRITON_PREFIX""x (see the summary above)" >&2
fi
exit "$rc"
