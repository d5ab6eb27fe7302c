#!/usr/bin/env bash
# The peers' own tests, patched: installs verl, TRL and OpenRLHF into the venv given as $1
# (default .venv, with ppo_fast installed, as .ci/run leaves it), fetches verl 0.9.1's own
# CPU tests from its source distribution (never committed), runs them unpatched and with
# ppo_fast.integrations.verl.patch() on the native backend and on Triton (through
# TRITON_INTERPRET=1), compares the pass sets, then runs tests/test_integrations_*.py.
# Exits non-zero when a test that passes with verl's own code does not pass patched
# (deviations listed in tests/peers/run_peer_tests.py aside) or when our tests fail.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
VENV="${1:-.venv}"
PY="$VENV/bin/python"
VERL_VERSION=0.9.1
TRL_VERSION=1.16.0
OPENRLHF_VERSION=0.11.2
started=$(date +%s)
step() { echo "== [$(( $(date +%s) - started ))s] $*"; }

# torch, transformers and the rest of what ppo_fast's suite runs on must not move: pin them
# to what is installed (verl's metadata asks for older transformers/tensordict; its core runs
# on these, see docs/integrations.md).
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$PY" -m pip freeze --exclude-editable | grep -iE '^(torch|transformers|triton|numpy|tokenizers|safetensors|huggingface[-_]hub)==' > "$work/constraints.txt" || true
step "installing the peers into $VENV (constraints: $(tr '\n' ' ' < "$work/constraints.txt"))"
"$PY" -m pip install -q --no-deps "verl==$VERL_VERSION" "openrlhf==$OPENRLHF_VERSION"
# What verl.trainer.ppo.core_algos imports, and what verl's tests/trainer/ppo/*_on_cpu.py
# import besides (ray_trainer: torchdata, peft, cachetools, uvicorn, fastapi); TRL with its deps.
"$PY" -m pip install -q -c "$work/constraints.txt" omegaconf ray tensordict codetiming pylatexenc orjson \
    torchdata peft cachetools uvicorn fastapi "trl==$TRL_VERSION"

step "fetching verl $VERL_VERSION's own tests from its source distribution"
"$PY" -m pip download -q --no-deps --no-binary :all: "verl==$VERL_VERSION" -d "$work/sdist"
tar -xzf "$work/sdist/verl-$VERL_VERSION.tar.gz" -C "$work" "verl-$VERL_VERSION/tests/trainer/ppo"
tests="$work/verl-$VERL_VERSION/tests/trainer/ppo"
ls "$tests"/*_on_cpu.py | sed 's|.*/|   |'

status=0
step "verl's own tests: unpatched, patched (native), patched (triton, interpreter)"
"$PY" tests/peers/run_peer_tests.py verl --tests "$tests" --modes unpatched,native,triton -W ignore::UserWarning || status=1

step "our integration tests"
"$PY" -m pytest tests/test_integrations_verl.py tests/test_integrations_verl_worker.py tests/test_integrations_trl.py tests/test_integrations_openrlhf.py -q -p no:cacheprovider || status=1

step "done (exit $status)"
exit $status
