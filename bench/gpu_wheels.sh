#!/usr/bin/env bash
# Downloads the wheels of bench/gpu_wheels.txt for the GPU machine's Python (CPython
# $PYTHON_VERSION, 3.12 there; manylinux x86-64) into DIR (default .whl, git-ignored), without their
# dependencies: the file names each one the image lacks.  bench/gpu_check.sh installs them there
# without an index.
#
#   bash bench/gpu_wheels.sh [DIR]
#   PYTHON_VERSION=3.11 bash bench/gpu_wheels.sh DIR   # for a rehearsal in another Python
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
mkdir -p "$DIR"
PLATFORMS=()
for n in 28 27 17; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
mapfile -t SPECS < <(grep -v '^\s*\(#\|$\)' bench/gpu_wheels.txt)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" --implementation cp \
    "${PLATFORMS[@]}" --platform manylinux2014_x86_64 -d "$DIR" "${SPECS[@]}"
echo "gpu_wheels: ${#SPECS[@]} wheels in $DIR ($(du -sh "$DIR" | cut -f1)): carry it to the GPU machine with the tree"
