#!/usr/bin/env bash
# Style and shape checks (CI): ruff lint and format (ruff.toml), clang-format over csrc/
# (.clang-format), and .ci/code_shape.py (functions of at most 80 lines outside kernels, no
# import cycle, the contract's names only in ppo_fast/spec.py).  Exit 1 on any finding.
#
#   bash .ci/lint.sh [VENV]      (default <repo>/.venv; installs the pinned lint extra into it)
# Fix with: ruff check --fix . && ruff format . && clang-format -i csrc/**/*.{h,cpp,cu,cuh}
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
"$VENV/bin/pip" install -q "ruff==0.17.6" "clang-format==23.1.5"
status=0
"$VENV/bin/ruff" check . || status=1
"$VENV/bin/ruff" format --check . || status=1
bash .ci/format.sh "$VENV" || status=1
"$VENV/bin/python" .ci/code_shape.py || status=1
exit $status
