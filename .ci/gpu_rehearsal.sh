#!/usr/bin/env bash
# The GPU check rehearsed without a GPU (bench/gpu_check.sh, REHEARSAL=1), in the torch 2.11 +
# triton 3.6 venv of `.ci/compat_torch.sh 2.11` (what the lent machine's image has) and its copy of
# the tree: the wheels for the device made by bench/gpu_wheels.sh and installed without an index, the
# build with the CUDA kernels for sm_90, every GPU test stage collected without an error, the plan,
# the summary.  A change that would break the real run on the GPU breaks this step.
#
#   bash .ci/gpu_rehearsal.sh [OUT]       # after .ci/compat_torch.sh 2.11
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${COMPAT_VENV:-$ROOT/.venv211}
case "$VENV" in /*) ;; *) VENV=$ROOT/$VENV ;; esac
OUT=${1:-$ROOT/bench/results/gpu-rehearsal}
mkdir -p "$OUT"
PY=$VENV/bin/python
[ -x "$PY" ] && [ -d "$VENV/src" ] || { echo "gpu_rehearsal: run .ci/compat_torch.sh 2.11 first ($VENV/src)" >&2; exit 2; }
PYTHON_VERSION=$("$PY" -c "import sys; print('%d.%d' % sys.version_info[:2])") bash bench/gpu_wheels.sh "$VENV/src/.whl"
# The 2-core CI machine builds the CUDA kernels in about 100 s, the GPU machine's 16 cores in less:
# the same plan on a longer clock.
cd "$VENV/src"
REHEARSAL=1 PYTHON=$PY OUT=$OUT TOTAL_S=${REHEARSAL_TOTAL_S:-1200} WHEELS=.whl bash bench/gpu_check.sh
