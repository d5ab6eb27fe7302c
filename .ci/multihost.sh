#!/usr/bin/env bash
# The multi-host tests (tests/test_multihost.py): network namespaces joined by a bridge, torchrun
# in each. Needs root and iproute2 (ip, tc), installed here if missing. Usage: .ci/multihost.sh [VENV]
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  apt-get update -qq && apt-get install -y -qq iproute2
fi
PYTHONPATH="$PWD" "$venv/bin/python" -m pytest tests/test_multihost.py -m multihost -n 0 -q -rs  # one at a time: the hosts share addresses
# On one host, the torchrun checks of asynchronous rollouts that take a run each (a producer's crash, a
# dead rank 0, a Ctrl-C): the full tier of tests/test_async_ranks.py, which the README's pytest leaves out.
# The tests under torchrun on one host (the full tier: left out of the README's pytest for its budget),
# one pytest-xdist worker per core as there (each run finds its own free port).
PYTHONPATH="$PWD" "$venv/bin/python" -m pytest tests/test_async_ranks.py tests/test_distributed.py tests/test_run_folder.py -m full -q -rs
