#!/usr/bin/env bash
# GPU check on a lent machine (no package index there: what its image lacks comes as wheels in
# $WHEELS, made here by bench/gpu_wheels.sh), all inside TOTAL_S (480 s):
#   preflight   versions; the wheels installed without an index, the image's torch and triton
#               pinned; the packages the tests and baselines import; nvcc against torch's CUDA;
#               ninja.  Without a GPU it stops here, exit 3 (unless REHEARSAL=1)
#   build       ppo_fast._C with its CUDA kernels for this GPU's architecture (ninja)
# Then, in the order of what the run must answer (a stage cut short costs the least valuable):
#   fused-head  the fused LM head's benchmark rows against its baselines
#   head-plans  the GEMM-first head's memory plans (the budget's 384 rows and bf16 d_weight, 512 rows,
#               the former 2048 rows and float32 accumulator) against cuBLAS's linear layer, and the
#               one-pass loss under two budgets against Liger's fused GRPO loss (python -m bench head_plans)
#   overhead    python -m bench overhead --device cuda: every public op's eager and device time
#   targets     python -m bench targets (the loss targets among them; saved as measured)
#   trainer     the trainer end to end on a Qwen2.5-0.5B-shaped Llama: ppo_fast GRPO against TRL's
#               GRPOTrainer unpatched and patched, then the fused head off, packing off, PPO (as the
#               stage's time allows: python -m bench trainer_e2e)
#   tests-native  the native CUDA tests and the no-host-sync test (the launch-count test apart)
#   tests-launch  the profiler launch-count test alone, in its own process; a crash (a signal) is
#               rerun once alone, to tell a crash of that test from one left by what ran before
#   tests-*     the other GPU tests in stages: the Triton kernels, the conformance matrix, its
#               torch.compile cases, the rest; one line per test in tests-*.log as it ends, so a
#               stage cut by its limit keeps every name
#   head-tiles  the "epilogue" design's forward against the 2-D plan at H = 4096 and 896 (first: the
#               design question), then the tile candidates and the vocabulary split (python -m bench head_tiles)
#   bench       the rest of the benchmark suite, with the time left
# Each stage must end by its deadline, the share of TOTAL_S up to it (DEADLINE below): a stage
# that ends early leaves its time to the next.  A TERM or INT (the device call's limit) stops the
# stage in flight and still writes the summary.  The last lines of summary.txt: one per target
# (met / missed, with the number), then one per stage.
#
#   bash bench/gpu_wheels.sh                 # here, once: the wheels for the device call (carry .whl)
#   bash bench/gpu_check.sh                  # on the GPU machine, from the repo root; results in $OUT
#   REHEARSAL=1 bash bench/gpu_check.sh      # without a GPU (CI): the preflight with its installs, the
#                                            # build for sm_90, every test stage's collection (no error,
#                                            # no empty stage), the plan, the summary; nothing measured
#
# Environment: OUT (bench/results), PYTHON (python3), TOTAL_S (480), WHEELS (.whl), TEST_WORKERS
# (8, pytest -n), BENCH_ARGS (extra benchmark flags), COMPILE=1 (torch.compile baselines too).
# Exit status: 0 only if every stage passed; 3 without a GPU (nothing built or measured).
set -u

cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
TOTAL_S="${TOTAL_S:-480}"
REHEARSAL="${REHEARSAL:-0}"
WHEELS="${WHEELS:-.whl}"
TEST_WORKERS="${TEST_WORKERS:-8}"
BENCH_ARGS="${BENCH_ARGS:-}"
export PYTHONUNBUFFERED=1
# A backend that does not load stops the tests with its import error instead of its tests skipping.
export PPO_FAST_REQUIRE_BACKENDS="${PPO_FAST_REQUIRE_BACKENDS-native,triton}"
START=$(date +%s)
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
declare -a RESULTS=()
STAGE=""
CHILD=""

# Percent of TOTAL_S by which each stage must have ended.
declare -A DEADLINE=(
    [preflight]=6 [build]=26 [fused-head]=38 [head-plans]=46 [overhead]=51 [targets]=59 [trainer]=71
    [tests-native]=74 [tests-launch]=77 [tests-triton]=81 [tests-matrix]=86 [tests-compile]=89 [tests-rest]=92
    [head-tiles]=96 [bench]=100
)
STAGES=(preflight build fused-head head-plans overhead targets trainer tests-native tests-launch tests-triton tests-matrix
    tests-compile tests-rest head-tiles bench)

say() { echo "$*" | tee -a "$SUMMARY"; }
elapsed() { echo $(($(date +%s) - START)); }
left_for() { echo $((START + TOTAL_S * DEADLINE[$1] / 100 - $(date +%s))); }

finish() {
    trap - TERM INT
    say ""
    say "summary after $(elapsed)s of ${TOTAL_S}s$([ "$REHEARSAL" = 1 ] && echo ' (rehearsal: no GPU, nothing measured)'):"
    if [ -f "$OUT/targets.json" ]; then
        "$PY" -m bench targets --summary "$OUT/targets.json" 2>&1 | sed 's/^/  /' | tee -a "$SUMMARY"
    fi
    local status=${1:-0}
    for line in "${RESULTS[@]}"; do
        say "  $line"
        case "$line" in *": ok in "* | *": skipped "*) ;; *) status=1 ;; esac
    done
    say "files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
    exit "$status"
}

on_signal() {
    RESULTS+=("interrupted by $1 after $(elapsed)s${STAGE:+, during $STAGE}")
    [ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null
    finish 1
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT

# in_background LOG CMD...: CMD's exit status, its output appended to LOG; in the background so
# that a TERM to this script is handled at once (on_signal stops CHILD).
in_background() {
    local log=$1
    shift
    "$@" >>"$log" 2>&1 &
    CHILD=$!
    wait "$CHILD"
    local rc=$?
    CHILD=""
    return "$rc"
}

# run_stage NAME LOG CMD...: CMD until the stage's deadline (killed there), its verdict recorded.
run_stage() {
    local name="$1" log="$2"
    shift 2
    local limit t0=$(date +%s)
    limit=$(left_for "$name")
    if [ "$limit" -lt 5 ]; then
        RESULTS+=("$name: NOT RUN (its deadline, ${DEADLINE[$name]}% of ${TOTAL_S}s, has passed)")
        return 1
    fi
    STAGE=$name
    echo "== $name (limit ${limit}s): $*" | tee -a "$log"
    in_background "$log" timeout --signal=TERM --kill-after=10 "$limit" "$@"
    local rc=$?
    STAGE=""
    local took=$(($(date +%s) - t0)) verdict="ok"
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

# --- preflight: no GPU needed.
say "ppo_fast GPU check$([ "$REHEARSAL" = 1 ] && echo ' REHEARSAL'), $(date -u +%Y-%m-%dT%H:%M:%SZ), ${TOTAL_S}s in all"
say "git: $(git rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout')"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee -a "$SUMMARY"
else
    say "gpu: no nvidia-smi"
fi
PREFLIGHT_LOG="$OUT/preflight.log"
: >"$PREFLIGHT_LOG"
# torch imported once: its versions (nothing installed here may replace the image's torch or
# triton: constraints.txt), its CUDA and the GPU's architecture (all empty when torch does not import).
TORCH_CUDA="" ARCH="" TORCH_LINE=""
eval "$("$PY" - "$OUT/constraints.txt" <<'EOF' 2>>"$PREFLIGHT_LOG"
import sys, torch, triton
open(sys.argv[1], "w").write(f"torch=={torch.__version__}\ntriton=={triton.__version__}\n")
arch = "%d.%d" % torch.cuda.get_device_capability() if torch.cuda.is_available() else ""
print(f"TORCH_CUDA={torch.version.cuda or ''} ARCH={arch} TORCH_LINE='torch {torch.__version__} (cuda {torch.version.cuda}), cuda available: {torch.cuda.is_available()}'")
EOF
)"
WHEEL_FILES=("$WHEELS"/*.whl)
if [ -f "${WHEEL_FILES[0]}" ]; then
    # One at a time: a wheel that does not fit this Python is reported, the others still installed.
    run_stage preflight "$PREFLIGHT_LOG" bash -c 'rc=0; for w in "${@:3}"; do
        "$1" -m pip install -q --no-index --no-deps --no-cache-dir -c "$2" "$w" || rc=1; done; exit $rc' \
        _ "$PY" "$OUT/constraints.txt" "${WHEEL_FILES[@]}"
else
    say "wheels: none in $WHEELS (bench/gpu_wheels.sh makes them): the baselines the image lacks will not run"
fi
"$PY" - "$OUT/preflight.json" "${TORCH_LINE:-torch: not importable}" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import importlib, importlib.metadata, importlib.util, json, sys

print(f"python {sys.version.split()[0]}, {sys.argv[2]}")
# What the tests import (collection fails without it), then the real baselines the benchmarks compare with.
needed = ["triton", "pytest", "xdist", "hypothesis", "yaml", "numpy", "transformers", "safetensors", "tqdm", "matplotlib", "ninja"]
baselines = {"liger_kernel": "liger_kernel.transformers", "liger_grpo": "liger_kernel.chunked_loss", "cut_cross_entropy": "cut_cross_entropy", "trl": "trl.trainer.utils"}
def version(name):
    try:
        return importlib.metadata.version({"yaml": "pyyaml", "xdist": "pytest-xdist"}.get(name, name))
    except importlib.metadata.PackageNotFoundError:
        return "found"
found = {}
for name in needed:  # found, not imported (slow): the tests' collection imports them
    found[name] = version(name) if importlib.util.find_spec(name) else None
    if not found[name]:
        print(f"  {name}: MISSING")
for name, module in baselines.items():  # imported: a baseline without its own needs is missing too
    try:
        found[name] = getattr(importlib.import_module(module.split(".")[0]), "__version__", "installed")
        importlib.import_module(module)
    except Exception as err:  # any import error: what the user would see
        found[name] = None
        print(f"  {name}: MISSING ({type(err).__name__}: {str(err).splitlines()[0][:120]})")
print("  present: " + ", ".join(f"{n} {v}" for n, v in found.items() if v))
missing = [n for n in needed if not found[n]]
missing_baselines = [n for n in baselines if not found[n]]
json.dump({"found": found, "missing_for_tests": missing, "missing_baselines": missing_baselines}, open(sys.argv[1], "w"), indent=1)
sys.exit(1 if missing else 2 if missing_baselines else 0)
EOF
case "${PIPESTATUS[0]}" in
    0) ;;
    2) RESULTS+=("preflight: FAILED (a baseline does not import, so the benchmarks run without it: $OUT/preflight.json)") ;;
    *) RESULTS+=("preflight: FAILED (a package the tests import is missing: $OUT/preflight.json)") ;;
esac
NVCC=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
NVCC_VERSION=$("$NVCC" --version 2>/dev/null | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
if [ -z "$NVCC_VERSION" ]; then
    RESULTS+=("preflight: FAILED (no nvcc: the CUDA kernels cannot be built, their tests would skip)")
elif [ "${NVCC_VERSION%%.*}" != "${TORCH_CUDA%%.*}" ]; then
    RESULTS+=("preflight: FAILED (nvcc $NVCC_VERSION, torch built with CUDA $TORCH_CUDA: another major version)")
fi
say "nvcc: ${NVCC_VERSION:-missing} ($NVCC), torch's CUDA: ${TORCH_CUDA:-none}"
if command -v ninja >/dev/null || "$PY" -c "import ninja" 2>/dev/null; then
    say "ninja: present (parallel build)"
else
    RESULTS+=("preflight: FAILED (no ninja: the build would be serial)")
fi

# The first GPU-only step is the build for the GPU's own architecture: without a GPU, stop here.
if [ -z "$ARCH" ] && [ "$REHEARSAL" = 1 ]; then
    ARCH=9.0 # the H200's
elif [ -z "$ARCH" ]; then
    say "gpu_check: no CUDA GPU visible to torch (torch.cuda.is_available() is False): stopping before the build; nothing measured"
    exit 3
fi
say "plan (${TOTAL_S}s): $(for s in "${STAGES[@]}"; do
    printf '%s by %ss, ' "$s" $((TOTAL_S * DEADLINE[$s] / 100))
done)"

# --- build: the CUDA kernels for this GPU's architecture.
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$ARCH}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
BUILD_LOG="$OUT/build.log"
: >"$BUILD_LOG"
PPO_FAST_BUILD_CUDA=1 run_stage build "$BUILD_LOG" "$PY" setup.py build_ext --inplace
"$PY" -c "import ppo_fast as pf, ppo_fast._C as C
print('CUDA kernels built:', C.built_with_cuda())
[print(f'backend {k}: {v}') for k, v in pf.available_backends().items()]
assert C.built_with_cuda()" 2>&1 | tee -a "$SUMMARY" "$BUILD_LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || RESULTS+=("build: FAILED (ppo_fast._C without its CUDA kernels: see build.log)")

# --- the GPU tests, in stages.
PYTEST=("$PY" -m pytest -p no:cacheprovider -o addopts= -rfEs --tb=short -m "cuda or triton_on_gpu")
"$PY" -c "import xdist" 2>/dev/null && [ "$REHEARSAL" != 1 ] && PYTEST+=(-n "$TEST_WORKERS")
STAGED=(tests/backends/test_native_cuda.py tests/backends/test_cuda_no_host_sync.py
    tests/backends/test_triton_kernels.py tests/backends/test_triton_truncation.py tests/test_conformance.py)
# Compile-only tests: the static report (bench static) covers them without a GPU.
COMPILE_ONLY=(tests/backends/test_triton_compiles_for_gpu.py tests/test_bench_static.py tests/test_gpu_check.py)
# test_stage NAME [per-device] PYTEST_ARGS...: "per-device": cells made for each device present
# (the conformance matrix), so that without a GPU none is collected, which the rehearsal allows.
test_stage() {
    local name=$1 log="$OUT/$1.log" allow_none=0
    shift
    [ "$1" = per-device ] && allow_none=1 && shift
    : >"$log"
    if [ "$REHEARSAL" = 1 ]; then
        run_stage "$name" "$log" bash -c '"${@:2}"; rc=$?; [ "$rc" = 5 ] && [ "$1" = 1 ] && rc=0; exit $rc' \
            _ "$allow_none" "${PYTEST[@]}" --collect-only -q "$@"
        local collected
        collected=$(grep -E "tests? (collected|deselected)|no tests ran" "$log" | tail -1)
        say "  $name: ${collected:-nothing collected}$([ "$allow_none" = 1 ] && echo ' (its CUDA cells exist only where a GPU is)')"
    else
        run_stage "$name" "$log" "${PYTEST[@]}" -v "$@"
        grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped|deselected|errors?)" "$log" | tail -15 | sed "s/^/  /" | tee -a "$SUMMARY"
        rerun_crashed "$name" "$log"
    fi
}
# The profiler launch-count test alone in a fresh process (CUPTI's state is per process); if a signal
# ends it, once more alone: the same crash again is the test's own.
LAUNCH_TEST=test_losses_cuda_launches_at_1m_tokens
launch_stage() {
    local log="$OUT/tests-launch.log" rc
    local id="tests/backends/test_native_cuda.py::$LAUNCH_TEST"
    : >"$log"
    if [ "$REHEARSAL" = 1 ]; then
        run_stage tests-launch "$log" "${PYTEST[@]}" --collect-only -q "$id"
        return
    fi
    run_stage tests-launch "$log" "${PYTEST[@]}" -n 0 -v "$id"
    rc=$?
    if [ "$rc" -gt 128 ] && [ "$rc" -lt 160 ] && [ "$rc" -ne 137 ]; then # 137: timeout's KILL
        echo "== tests-launch: again alone after signal $((rc - 128))" >>"$log"
        in_background "$log" timeout --signal=TERM --kill-after=5 60 "${PYTEST[@]}" -n 0 -v "$id"
        rc=$?
        say "  tests-launch: crashed (signal $((rc - 128)) first); alone again in a fresh process: exit $rc"
    fi
}
# A test whose xdist worker crashed runs again alone, in a fresh process (a few, a minute each): a
# crash that does not repeat there came from what ran before it on that worker.
rerun_crashed() {
    local name=$1 log=$2 id rc
    local -a ids
    mapfile -t ids < <(sed -n "s/.*worker '[^']*' crashed while running '\([^']*\)'.*/\1/p" "$log" | sort -u | head -3)
    for id in "${ids[@]}"; do
        echo "== $name: $id alone" >>"$log"
        in_background "$log" timeout --signal=TERM --kill-after=5 60 "${PYTEST[@]}" -n 0 "$id"
        rc=$?
        say "  $name: $id crashed its worker; alone in a fresh process: exit $rc$([ "$rc" -gt 128 ] && [ "$rc" -lt 160 ] && echo " (signal $((rc - 128)))")"
    done
}
if [ "$REHEARSAL" = 1 ]; then
    for s in fused-head head-plans overhead targets trainer; do RESULTS+=("$s: skipped (rehearsal: no GPU)"); done
else
    # --- the fused LM head's rows against its baselines, first: the question this run answers first.
    mkdir -p "$OUT/fused_head"
    run_stage fused-head "$OUT/fused_head/bench.log" \
        "$PY" -m bench --device cuda --ops linear_token_logprobs --no-compile --out "$OUT/fused_head"
    # --- the head's memory plans against cuBLAS and the one pass against Liger's GRPO loss (a JSON row
    # written as each is measured; Liger's eager chunks: its torch.compile would take the stage's time).
    run_stage head-plans "$OUT/fused_head/head-plans.log" \
        "$PY" -m bench head_plans --device cuda --rep-ms 100 --out "$OUT/fused_head/head-plans.json"
    # --- every public op's eager and device time on tiny inputs (bench.timing's rule).
    run_stage overhead "$OUT/overhead.log" "$PY" -m bench overhead --device cuda --out "$OUT"
    # --- the targets, each saved to targets.json as it is measured.
    COMPILE_FLAG=()
    [ "${COMPILE:-0}" = "1" ] && COMPILE_FLAG=(--compile)
    run_stage targets "$OUT/targets.log" \
        "$PY" -m bench targets --device cuda --out "$OUT" --budget-s $(($(left_for targets) * 3 / 4)) "${COMPILE_FLAG[@]}"
    # --- the trainer end to end (issue 50's third question): no set-up starts in the stage's last fifth.
    run_stage trainer "$OUT/trainer-e2e.log" \
        "$PY" -m bench trainer_e2e --device cuda --out "$OUT" --budget-s $(($(left_for trainer) * 4 / 5))
fi

test_stage tests-native "${STAGED[@]:0:2}" -k "not $LAUNCH_TEST"
launch_stage
test_stage tests-triton "${STAGED[@]:2:2}"
test_stage tests-matrix per-device tests/test_conformance.py -k "not compiled"
test_stage tests-compile per-device tests/test_conformance.py -k compiled
test_stage tests-rest tests $(printf -- '--ignore=%s ' "${STAGED[@]}" "${COMPILE_ONLY[@]}")

if [ "$REHEARSAL" = 1 ]; then
    for s in head-tiles bench; do RESULTS+=("$s: skipped (rehearsal: no GPU)"); done
    finish
fi

# --- the "epilogue" forward's candidates against the 2-D plan (H = 4096, then 896), then the tile
# candidates, forward and backward, and the vocabulary split (the JSON rewritten as each is measured).
run_stage head-tiles "$OUT/fused_head/head-tiles.log" \
    "$PY" -m bench head_tiles --device cuda --rows 8192 --also-hidden 896 --rep-ms 100 \
    --out "$OUT/fused_head/head-tiles.json"

# --- the packed layout's kernels (Triton gae and kl_penalized_rewards, the native CUDA segmented losses)
# against the padded detour and padded tensors, eager and device time (about a minute, predicted), in the
# bench stage's time.
run_stage bench "$OUT/packed.log" "$PY" -m bench packed --device cuda --quick --min-run-time 0.1 \
    --out "$OUT/packed-cuda.json"

# --- the rest of the suite with the time left; it saves its JSON after every case.
BENCH_LOG="$OUT/bench.log"
: >"$BENCH_LOG"
budget=$(($(left_for bench) * 2 / 3)) # stop starting cases early enough for the one in flight and the report
[ "${COMPILE:-0}" = "1" ] || BENCH_ARGS="--no-compile $BENCH_ARGS"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
run_stage bench "$BENCH_LOG" \
    "$PY" -m bench --device cuda --ops token_logprobs,gae,kl_penalized_rewards,clipped_policy_loss,value_loss \
    --out "$OUT" --budget-s "$budget" $BENCH_ARGS
for json in "$OUT"/cuda*.json; do
    [ -f "$json" ] || continue
    "$PY" -m bench report "$json" --plot "${json%.json}.png" >"${json%.json}.md" 2>>"$BENCH_LOG" \
        || RESULTS+=("report of $(basename "$json"): FAILED (see bench.log)")
done
grep -E "^FAILED|^  .*: (error|mismatch)" "$BENCH_LOG" | head -20 | sed 's/^/  /' | tee -a "$SUMMARY"

finish
