#!/usr/bin/env bash
# GPU check on a fresh machine without network, targets first, within ~9 minutes:
#   0. preflight (no GPU needed): versions, tools; stops here, exit 3, when no CUDA GPU is visible
#   1. build the extension for this GPU's architecture only
#   2. the GPU tests in parallel (pytest -n, when pytest-xdist is installed), without the
#      compile-only tests (the static report covers those without a GPU)
#   3. the targets (python -m bench targets): log-probs [16384, 151936] bf16, GAE [64, 8192],
#      the losses at 16M and 1M tokens, the fused LM head if present
#   4. the rest of the benchmark suite with the time left (no torch.compile baselines
#      unless COMPILE=1)
#   5. where vllm is installed: rollout speed, hf against vllm (bench/vllm_rollout.py)
# Every stage runs under its own hard time limit and writes into $OUT as it goes, so a
# timeout still leaves what was measured; a failed stage does not stop the next one.
# The last lines of summary.txt: one per target (met / missed, with the number), then
# one per stage.
#
#   bash bench/gpu_check.sh            # from the repo root; results in $OUT (default bench/results)
#
# Stage limits (seconds): BUILD_S (200), TESTS_S (120), TARGETS_S (150), FUSED_S (150, the
# fused LM head's own cases after the targets), VLLM_S (180); the
# suite gets the rest of TOTAL_S (540) less VLLM_S where vllm is installed.  TEST_WORKERS
# (8): pytest -n.  Extra benchmark flags: BENCH_ARGS.
# Exit status: 0 only if every stage passed; 3 without a GPU (nothing built or measured).
set -u

cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
TOTAL_S="${TOTAL_S:-540}"
BUILD_S="${BUILD_S:-200}"
TESTS_S="${TESTS_S:-120}"
TARGETS_S="${TARGETS_S:-150}"
TEST_WORKERS="${TEST_WORKERS:-8}"
BENCH_ARGS="${BENCH_ARGS:-}"
START=$(date +%s)
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
declare -a RESULTS=()

say() { echo "$*" | tee -a "$SUMMARY"; }
elapsed() { echo $(($(date +%s) - START)); }

# run_stage NAME LIMIT_S LOG CMD...: runs CMD under a hard time limit, records its status.
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

finish() {
    say ""
    say "summary after $(elapsed)s:"
    if [ -f "$OUT/targets.json" ]; then
        "$PY" -m bench targets --summary "$OUT/targets.json" 2>&1 | sed 's/^/  /' | tee -a "$SUMMARY"
    fi
    local status=0
    for line in "${RESULTS[@]}"; do
        say "  $line"
        case "$line" in *": ok in "*) ;; *) status=1 ;; esac
    done
    say "files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
    exit "$status"
}

# --- 0. preflight: everything here runs without a GPU.
say "ppo_fast GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
say "git: $(git rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee -a "$SUMMARY"
"$PY" - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import importlib.util, sys, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (cuda {torch.version.cuda}), cuda available: {torch.cuda.is_available()}")
for name in ("triton", "pytest", "xdist", "hypothesis", "transformers", "matplotlib", "ninja", "liger_kernel", "flash_attn"):
    found = importlib.util.find_spec(name) is not None
    version = " " + __import__(name).__version__ if found and name in ("triton", "transformers") else ""
    print(f"  {name}: {'installed' + version if found else 'missing'}")
EOF
# The first GPU-only step is the build (it compiles for the GPU's own architecture): without a GPU, stop here.
ARCH=$("$PY" -c "import torch; assert torch.cuda.is_available(); print('%d.%d' % torch.cuda.get_device_capability())" 2>/dev/null)
if [ -z "$ARCH" ]; then
    say "gpu_check: no CUDA GPU visible to torch (torch.cuda.is_available() is False): stopping before the build; nothing measured"
    exit 3
fi

# --- 1. build: CUDA kernels for this GPU's architecture only; CPU-only build if CUDA cannot be built.
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$ARCH}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
BUILD_LOG="$OUT/build.log"
: >"$BUILD_LOG"
if ! PPO_FAST_BUILD_CUDA=1 run_stage "build (with CUDA, arch $TORCH_CUDA_ARCH_LIST)" "$BUILD_S" "$BUILD_LOG" \
    "$PY" setup.py build_ext --inplace; then
    PPO_FAST_BUILD_CUDA=0 run_stage "build (CPU only, after the CUDA build failed)" 120 "$BUILD_LOG" \
        "$PY" setup.py build_ext --inplace
fi
"$PY" -c "import ppo_fast as pf; [print(f'backend {k}: {v}') for k, v in pf.available_backends().items()]" 2>&1 | tee -a "$SUMMARY"

# --- 2. GPU tests, in parallel, without the compile-only tests.
TESTS_LOG="$OUT/tests.log"
: >"$TESTS_LOG"
if "$PY" -c "import pytest" 2>/dev/null; then
    PARALLEL=(-o addopts=)  # pyproject's -n needs pytest-xdist, which a bare image may lack
    "$PY" -c "import xdist" 2>/dev/null && PARALLEL+=(-n "$TEST_WORKERS")
    run_stage "tests (pytest -m 'cuda or triton_on_gpu' ${PARALLEL[*]})" "$TESTS_S" "$TESTS_LOG" \
        "$PY" -m pytest -q -rfEs -p no:cacheprovider "${PARALLEL[@]}" -m "cuda or triton_on_gpu" \
        --ignore=tests/backends/test_triton_compiles_for_gpu.py --ignore=tests/test_bench_static.py --ignore=tests/test_gpu_check.py tests
    grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped|deselected|errors?)" "$TESTS_LOG" | tail -25 | sed 's/^/  /' | tee -a "$SUMMARY"
else
    RESULTS+=("tests: NOT RUN (pytest is not installed)")
fi

# --- 3. the targets, each saved to targets.json as it is measured.
TARGETS_LOG="$OUT/targets.log"
: >"$TARGETS_LOG"
COMPILE_FLAG=()
[ "${COMPILE:-0}" = "1" ] && COMPILE_FLAG=(--compile)
run_stage "targets (python -m bench targets)" "$TARGETS_S" "$TARGETS_LOG" \
    "$PY" -m bench targets --device cuda --out "$OUT" --budget-s $((TARGETS_S * 3 / 4)) "${COMPILE_FLAG[@]}"

# --- fused LM head: its GPU rows alone, before the suite, so that the suite's budget cannot cut them.
FUSED_S="${FUSED_S:-150}"
mkdir -p "$OUT/fused_head"
run_stage "bench fused LM head (linear_token_logprobs)" "$FUSED_S" "$OUT/fused_head/bench.log" \
    "$PY" -m bench --device cuda --ops linear_token_logprobs --no-compile --out "$OUT/fused_head"
# --- end of the fused LM head block

# --- 4. the rest of the suite with the time left; it saves its JSON after every case.
VLLM_S="${VLLM_S:-180}"
HAS_VLLM=0
"$PY" -c "import vllm" 2>/dev/null && HAS_VLLM=1
BENCH_LOG="$OUT/bench.log"
: >"$BENCH_LOG"
left=$((TOTAL_S - $(elapsed) - HAS_VLLM * VLLM_S))
if [ "$left" -lt 60 ]; then
    RESULTS+=("bench: NOT RUN (only ${left}s left of ${TOTAL_S}s)")
else
    budget=$((left * 2 / 3))  # stop starting cases early enough for the one in flight and the report
    [ "${COMPILE:-0}" = "1" ] || BENCH_ARGS="--no-compile $BENCH_ARGS"
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
    run_stage "bench (python -m bench --device cuda $BENCH_ARGS, case budget ${budget}s)" "$left" "$BENCH_LOG" \
        "$PY" -m bench --device cuda --ops token_logprobs,gae,kl_penalized_rewards,clipped_policy_loss,value_loss \
        --out "$OUT" --budget-s "$budget" $BENCH_ARGS
    for json in "$OUT"/cuda*.json; do
        [ -f "$json" ] || continue
        "$PY" -m bench report "$json" --plot "${json%.json}.png" >"${json%.json}.md" 2>>"$BENCH_LOG" \
            || RESULTS+=("report of $(basename "$json"): FAILED (see bench.log)")
    done
    grep -E "^FAILED|^  .*: (error|mismatch)" "$BENCH_LOG" | head -20 | sed 's/^/  /' | tee -a "$SUMMARY"
fi

# --- 5. rollout speed, hf against vllm (bench/vllm_rollout.py), only where vllm is installed.
if [ "$HAS_VLLM" = "1" ]; then
    run_stage "vllm rollout (python -m bench vllm_rollout --device cuda)" "$VLLM_S" "$OUT/vllm.log" \
        "$PY" -m bench vllm_rollout --device cuda --model llama-50M --batch 256 --response-length 128 --out "$OUT"
    grep -E "^\|" "$OUT/vllm.log" | sed 's/^/  /' | tee -a "$SUMMARY"
else
    say "vllm rollout: not run (vllm is not installed; not a failure)"
fi

finish
