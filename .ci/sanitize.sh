#!/usr/bin/env bash
# The C++ CPU kernels under AddressSanitizer + UndefinedBehaviorSanitizer.
#
# Builds ppo_fast._C with PPO_FAST_SANITIZE=address,undefined (setup.py: -fsanitize=
# address,undefined,float-cast-overflow -fno-sanitize-recover=all, -O1 -g1, CPU kernels
# only) in a copy of the working tree, never in the tree itself (the main venv's editable
# install keeps its extension, ppo_fast/_C*.so, in the source tree), then runs from that
# copy, with the venv's python: the bad-input tests (their C++ calls run in a subprocess,
# which inherits the sanitizer environment), the native CPU-op tests, and the native cases
# of the conformance matrix (non-finite rules, edge shapes, opcheck) and of the edge-value reproducers, each file
# in its own pytest (a report aborts the process it is in, so one abort does not hide the
# other files' results).
#
# Fails on a test failure and on any sanitizer report, also one in a subprocess whose
# crash a test only records, or where pytest passed.  Each process with a report leaves a
# file in the reports folder (log_path), printed at the end: ASan writes its whole report
# there; GCC's libubsan, next to a preloaded ASan, prints the report itself to stderr
# (pytest runs with --capture=sys, so the kernels' fd 2 reaches the log) and only its
# SUMMARY line (check, file:line) to the file.
#
# The interpreter is not instrumented, so the ASan runtime is preloaded (LD_PRELOAD;
# without it the import stops at "ASan runtime does not come first in initial library
# list"), and libstdc++ with it: ASan intercepts __cxa_throw, and with only libasan
# preloaded into python (a C program) libstdc++ is not loaded yet when ASan looks up the
# real function, so the first C++ exception thrown afterwards (libtriton's pybind11
# import, at `import ppo_fast`) dies in "CHECK failed: ... real___cxa_throw != 0".  Torch's
# own libraries need nothing else (no verify_asan_link_order=0); protect_shadow_gap=0 only
# where a GPU is visible (its driver maps memory in ASan's shadow gap).  libubsan is not
# preloaded: the extension links it, and it has no "must come first" check.  Leak
# detection is off: the interpreter and torch keep allocations until exit by design.
#
#   bash .ci/sanitize.sh [VENV]        (from anywhere; VENV default <repo>/.venv)
# Environment (all optional):
#   SANITIZE_DIR          work folder: the copy (src/), objects (build/), reports, log
#                         (default VENV/sanitize: git-ignored with the venv; objects are
#                         reused by a rerun, sources the copy keeps the mtimes of)
#   SANITIZE_PYTEST_ARGS  extra pytest arguments
#   SANITIZE_TIMEOUT      limit for each pytest in seconds (default 900)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export PYTHONUNBUFFERED=1

VENV=${1:-.venv}
case "$VENV" in /*) ;; *) VENV=$ROOT/$VENV ;; esac
PY=$VENV/bin/python
WORK=${SANITIZE_DIR:-$VENV/sanitize}
case "$WORK" in /*) ;; *) WORK=$ROOT/$WORK ;; esac
SRC=$WORK/src
REPORTS=$WORK/reports
LOG=$WORK/pytest.log
[ -x "$PY" ] || { echo "sanitize: no python at $PY (give the venv as the first argument)" >&2; exit 2; }

t0=$SECONDS
echo "== sanitize: copying the tree into $SRC"
bash "$ROOT/.ci/copy_tree.sh" "$SRC" "$VENV"
rm -rf "$REPORTS" && mkdir -p "$REPORTS" "$WORK/build"

echo "== sanitize: building ppo_fast._C with PPO_FAST_SANITIZE=address,undefined in $SRC"
t1=$SECONDS
(cd "$SRC" && PPO_FAST_SANITIZE=address,undefined PPO_FAST_BUILD_CUDA=0 \
    "$PY" setup.py -q build_ext --inplace --build-temp "$WORK/build" >"$WORK/build.log" 2>&1) \
    || { tail -n 60 "$WORK/build.log" >&2; echo "sanitize: the build failed (log: $WORK/build.log)" >&2; exit 1; }
so=$(ls "$SRC"/ppo_fast/_C*.so)
# ldd's output is kept first: `ldd | grep -q` under pipefail fails when grep exits before ldd ends (SIGPIPE).
linked=$(ldd "$so")
grep -q libasan <<<"$linked" || { echo "sanitize: $so does not link libasan" >&2; exit 1; }
grep -q libubsan <<<"$linked" || { echo "sanitize: $so does not link libubsan" >&2; exit 1; }
echo "sanitize: built in $((SECONDS - t1)) s"

# The sanitizer runtime of the compiler that built the extension, first; libstdc++ after it.
CXX_BIN=${CXX:-c++}
libasan=$("$CXX_BIN" -print-file-name=libasan.so)
libstdcxx=$("$CXX_BIN" -print-file-name=libstdc++.so)
for lib in "$libasan" "$libstdcxx"; do
    [ -f "$lib" ] || { echo "sanitize: $CXX_BIN has no $(basename "$lib") ($lib)" >&2; exit 1; }
done
san_env=(
    LD_PRELOAD="$libasan $libstdcxx"
    ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:check_initialization_order=1:detect_stack_use_after_return=1:log_path=$REPORTS/asan"
    # print_summary=1 spelled out: libubsan, next to ASan, writes no SUMMARY (file) without it.
    UBSAN_OPTIONS="print_stacktrace=1:report_error_type=1:print_summary=1:halt_on_error=1:abort_on_error=1:log_path=$REPORTS/ubsan"
    PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}"
)
# A GPU's driver maps memory in ASan's shadow gap: without this, CUDA fails to initialize.
if compgen -G "/dev/nvidia[0-9]*" >/dev/null; then
    san_env[1]="${san_env[1]}:protect_shadow_gap=0"
fi

(cd "$SRC" && env "${san_env[@]}" "$PY" -c "
import ppo_fast, ppo_fast._C as C, torch
assert ppo_fast.__file__.startswith('$SRC/'), ppo_fast.__file__
assert C.__file__.startswith('$SRC/'), C.__file__
assert not C.built_with_cuda()
x = torch.randn(4, 11)
torch.ops.ppo_fast.token_logprobs(x, torch.randint(0, 11, (4,)), 1.0, True, -100)
print('sanitize: ppo_fast from', ppo_fast.__file__, '| extension', C.__file__)
") || { cat "$REPORTS"/* 2>/dev/null >&2 || true; echo "sanitize: the sanitized extension does not load" >&2; exit 1; }

# tests/backends/test_native_* whole; of the conformance matrix, the edge values and the packed layout, the native
# backend's cases (their Triton and reference cases run no C++ kernel).
echo "== sanitize: pytest under ASan + UBSan"
t2=$SECONDS
rc=0
: >"$LOG"
run_pytest() {  # run_pytest ARGS...: one pytest from the copy, tee'd into the log
    local status
    echo "== sanitize: pytest $*" | tee -a "$LOG"
    set +e
    (cd "$SRC" && env "${san_env[@]}" timeout "${SANITIZE_TIMEOUT:-900}" "$PY" -m pytest -p no:cacheprovider \
        -n 0 -q -rfE --tb=short --capture=sys -W ignore::DeprecationWarning -m "not cuda" "$@" ${SANITIZE_PYTEST_ARGS:-}) 2>&1 |
        tee -a "$LOG"
    status=${PIPESTATUS[0]}
    set -e
    [ "$status" -eq 0 ] || { echo "sanitize: pytest $* exited with $status" | tee -a "$LOG"; rc=1; }
}
run_pytest tests/backends/test_native_bad_inputs.py
run_pytest tests/backends/test_native_cpu_ops.py
run_pytest tests/test_conformance.py -k native
run_pytest tests/test_edge_values.py -k native
run_pytest tests/test_varlen.py -k native  # the packed layout (cu_seqlens) on the native kernels
run_pytest tests/test_linear_policy_loss.py -k "packed_sequence_level and native"  # its C++ rows from cu_seqlens
echo "sanitize: pytest in $((SECONDS - t2)) s"

# Every process's report file (asan.<pid>, ubsan.<pid>), from pytest or any process it
# started, into the log; then any report file or sanitizer line in the log fails the run.
for report in "$REPORTS"/*; do
    [ -e "$report" ] || continue
    echo "== sanitize: report $(basename "$report")"
    cat "$report"
done 2>&1 | tee -a "$LOG"
if compgen -G "$REPORTS/*" >/dev/null || grep -qE "runtime error:|AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer" "$LOG"; then
    echo "sanitize: FAILED: sanitizer reports (above; $REPORTS, log $LOG):" >&2
    grep -E "runtime error:|ERROR: AddressSanitizer|SUMMARY: (AddressSanitizer|UndefinedBehaviorSanitizer)" "$LOG" |
        sed -E 's/^[.FEsx]+//; s/^==[0-9]+==//' | sort | uniq -c >&2 || true
    rc=1
fi
echo "sanitize: total $((SECONDS - t0)) s, exit status $rc"
exit "$rc"
