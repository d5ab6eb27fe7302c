#!/usr/bin/env bash
# The examples (examples/*.py), each run as a user runs it, from its folder, with the venv given
# as $1 (default .venv; the peers step has installed TRL and verl into it).  Exit 1 on the first
# that fails.
set -euo pipefail
cd "$(dirname "$0")/../examples"
PY="$(cd .. && pwd)/${1:-.venv}/bin/python"
for example in custom_reward.py trl_grpo.py verl_core.py; do
    started=$SECONDS
    echo "== examples/$example"
    "$PY" "$example" 2>&1 | tail -5
    echo "   ok in $((SECONDS - started)) s"
done
