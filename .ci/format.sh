#!/usr/bin/env bash
# Checks that every C++/CUDA source under csrc/ is formatted as .clang-format says
# (clang-format --dry-run --Werror); exit status 1 on any difference.
#
#   bash .ci/format.sh [VENV]    clang-format from VENV/bin (default <repo>/.venv), else from PATH
# Fix the sources with: clang-format -i $(git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh')
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

VENV=${1:-.venv}
case "$VENV" in /*) ;; *) VENV=$ROOT/$VENV ;; esac
# The venv's pinned clang-format first (pyproject's lint extra): another version formats differently.
if [ -x "$VENV/bin/clang-format" ]; then
    CLANG_FORMAT=$VENV/bin/clang-format
elif command -v clang-format >/dev/null 2>&1; then
    CLANG_FORMAT=$(command -v clang-format)
else
    echo "format: no clang-format on PATH or in $VENV/bin (pip install clang-format)" >&2
    exit 2
fi

mapfile -t files < <(find csrc -type f \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' \) | sort)
[ "${#files[@]}" -gt 0 ] || { echo "format: no sources under csrc/" >&2; exit 2; }
echo "format: $("$CLANG_FORMAT" --version) over ${#files[@]} files"
if ! "$CLANG_FORMAT" --dry-run --Werror "${files[@]}"; then
    echo "format: FAILED: run $CLANG_FORMAT -i on the files above" >&2
    exit 1
fi
echo "format: ok"
