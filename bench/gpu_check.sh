#!/usr/bin/env bash
# GPU check on a fresh machine without network: build the extension in place, run the
# CUDA tests (pytest -m cuda) and the benchmark suite on cuda, all within ~8 minutes.
#
#   bash bench/gpu_check.sh            # from the repo root; results in $OUT or bench/results/
#
# Every stage has its own time limit and log; a failed stage does not stop the next one.
# Files written (10 at most, flat): summary.txt build.log tests.log bench.log cuda.json
# cuda-speedup.png cuda-gbps.png cuda.md, and where vllm is installed vllm.log
# vllm-rollout-cuda.json.  Exit status: 0 only if every stage passed.
# Override the stage limits (seconds) with BUILD_S, TESTS_S; the benchmark gets the rest
# of TOTAL_S (default 470).  Extra benchmark flags: BENCH_ARGS (e.g. "--no-compile").
set -u

cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
TOTAL_S="${TOTAL_S:-470}"
BUILD_S="${BUILD_S:-200}"
TESTS_S="${TESTS_S:-150}"
BENCH_ARGS="${BENCH_ARGS:-}"
START=$(date +%s)
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
declare -a RESULTS=()

say() { echo "$*" | tee -a "$SUMMARY"; }
elapsed() { echo $(($(date +%s) - START)); }

# run_stage NAME LIMIT_S LOG CMD...: runs CMD under a time limit, records its status.
run_stage() {
    local name="$1" limit="$2" log="$3"
    shift 3
    local t0=$(date +%s)
    echo "== $name (limit ${limit}s): $*" | tee -a "$log"
    timeout --signal=TERM --kill-after=15 "$limit" "$@" >>"$log" 2>&1
    local rc=$?
    local took=$(($(date +%s) - t0))
    local verdict="ok"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        verdict="TIMEOUT"
    elif [ "$rc" -eq 5 ] && [[ "$name" == tests* ]]; then
        verdict="NO TESTS COLLECTED (exit 5)"
    elif [ "$rc" -ne 0 ]; then
        verdict="FAILED (exit $rc)"
    fi
    RESULTS+=("$name: $verdict in ${took}s (log: $(basename "$log"))")
    echo "== $name: $verdict in ${took}s" | tee -a "$log"
    return "$rc"
}

say "ppo_fast GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
say "git: $(git rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee -a "$SUMMARY"
"$PY" - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import importlib.util, sys, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (cuda {torch.version.cuda}), cuda available: {torch.cuda.is_available()}")
for name in ("triton", "pytest", "hypothesis", "transformers", "matplotlib", "ninja", "liger_kernel", "flash_attn"):
    found = importlib.util.find_spec(name) is not None
    version = ""
    if found and name in ("triton", "transformers"):
        version = " " + __import__(name).__version__
    print(f"  {name}: {'installed' + version if found else 'missing'}")
EOF

# --- 1. build: CUDA kernels for this GPU's architecture only (faster); CPU-only build if CUDA cannot be built.
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
    TORCH_CUDA_ARCH_LIST=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2>/dev/null) || unset TORCH_CUDA_ARCH_LIST
    [ -n "${TORCH_CUDA_ARCH_LIST:-}" ] && export TORCH_CUDA_ARCH_LIST
fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
BUILD_LOG="$OUT/build.log"
: >"$BUILD_LOG"
if ! PPO_FAST_BUILD_CUDA=1 run_stage "build (with CUDA, arch ${TORCH_CUDA_ARCH_LIST:-default})" "$BUILD_S" "$BUILD_LOG" \
    "$PY" setup.py build_ext --inplace; then
    left=$((BUILD_S - $(elapsed)))
    [ "$left" -lt 60 ] && left=60
    PPO_FAST_BUILD_CUDA=0 run_stage "build (CPU only, after the CUDA build failed)" "$left" "$BUILD_LOG" \
        "$PY" setup.py build_ext --inplace
fi
"$PY" -c "import ppo_fast as pf; [print(f'backend {k}: {v}') for k, v in pf.available_backends().items()]" 2>&1 | tee -a "$SUMMARY"

# --- 2. GPU tests (transformers may be missing here; the ops tests do not need it).
TESTS_LOG="$OUT/tests.log"
: >"$TESTS_LOG"
if "$PY" -c "import pytest" 2>/dev/null; then
    # The CUDA-marked tests, and the Triton tests, which run on the GPU when there is one.
    run_stage "tests (pytest -m cuda; Triton tests on cuda)" "$TESTS_S" "$TESTS_LOG" \
        "$PY" -m pytest -q -rfEs --continue-on-collection-errors -p no:cacheprovider \
        -m "cuda or triton_on_gpu" tests
    grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped|deselected|errors?)" "$TESTS_LOG" | tail -25 | sed 's/^/  /' | tee -a "$SUMMARY"
else
    RESULTS+=("tests: NOT RUN (pytest is not installed)")
fi

# --- fused LM head (#11): its GPU rows alone, first, so that the suite's budget cannot cut them.
FUSED_S="${FUSED_S:-150}"
mkdir -p "$OUT/fused_head"
run_stage "bench fused LM head (linear_token_logprobs)" "$FUSED_S" "$OUT/fused_head/bench.log" \
    "$PY" -m bench --device cuda --ops linear_token_logprobs --no-compile --out "$OUT/fused_head"
# --- end of the fused LM head block

# --- 3. benchmark suite on cuda, with the time left; it saves its JSON after every case.
BENCH_LOG="$OUT/bench.log"
: >"$BENCH_LOG"
left=$((TOTAL_S - $(elapsed)))
if [ "$left" -lt 60 ]; then
    RESULTS+=("bench: NOT RUN (only ${left}s left of ${TOTAL_S}s)")
else
    # Stop starting cases early enough for the case in flight, the end-to-end run and the plots.
    budget=$((left * 2 / 3))
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
    run_stage "bench (python -m bench --device cuda, case budget ${budget}s)" "$left" "$BENCH_LOG" \
        "$PY" -m bench --device cuda --out "$OUT" --budget-s "$budget" $BENCH_ARGS
    # Also after a timeout: render what was measured (cuda.json, or cuda-quick.json with --quick).
    for json in "$OUT"/cuda*.json; do
        [ -f "$json" ] || continue
        "$PY" -m bench.report "$json" --plots >"${json%.json}.md" 2>>"$BENCH_LOG" \
            || RESULTS+=("report of $(basename "$json"): FAILED (see bench.log)")
    done
    grep -E "^FAILED|^  .*: (error|mismatch)" "$BENCH_LOG" | head -20 | sed 's/^/  /' | tee -a "$SUMMARY"
fi

# --- 4. rollout speed, hf against vllm (bench/vllm_rollout.py), only where vllm is installed.
VLLM_S="${VLLM_S:-180}"
if "$PY" -c "import vllm" 2>/dev/null; then
    run_stage "vllm rollout (python -m bench.vllm_rollout --device cuda)" "$VLLM_S" "$OUT/vllm.log" \
        "$PY" -m bench.vllm_rollout --device cuda --model llama-50M --batch 256 --response-length 128 --out "$OUT"
    grep -E "^\|" "$OUT/vllm.log" | sed 's/^/  /' | tee -a "$SUMMARY"
else
    say "vllm rollout: not run (vllm is not installed; not a failure)"
fi

say ""
say "summary after $(elapsed)s:"
status=0
for line in "${RESULTS[@]}"; do
    say "  $line"
    case "$line" in *": ok in "*) ;; *) status=1 ;; esac
done
say "files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
exit "$status"
