"""Every Triton kernel variant compiles for a Hopper GPU (sm_90) with the specialisation a
real launch gives it, its address arithmetic is 64-bit, and the static performance budgets
of ``bench.static`` hold (registers, spills, 128-bit loads, SASS instructions per logit).

``bench.static`` runs the launchers on ``meta`` tensors of the target shapes and hands each
intercepted launch to Triton's own binder, so the compiled code is the code that runs: the
divisibility-by-16 hints on pointers and ints, ints equal to 1 made constexpr, i32 for the
ints that fit.  The interpreter accepts code that the compiler rejects, so the CPU tests
alone would not catch a kernel that does not compile.  Compilation runs in a subprocess:
conftest sets TRITON_INTERPRET=1, under which kernels cannot be compiled.

The int64 check: a Python int that fits reaches a kernel as ``i32``, so ``t * stride`` in
int32 wraps once ``T * stride`` passes 2**31; every ``tt.addptr`` offset must be i64 and
no i32 multiply may take a kernel argument.
"""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _check_int64_addressing(name: str, ttir: str, int_args: list[str]) -> None:
    for line in ttir.splitlines():
        code = line.split(" loc(")[0]
        if "tt.addptr" in code:
            offset_type = code.rsplit(",", 1)[-1].strip()
            assert offset_type == "i64" or offset_type.endswith("xi64>"), (
                f"{name}: 32-bit address offset: {code.strip()}"
            )
        if "arith.muli" in code and re.search(r":\s*(i32|tensor<[0-9x]*xi32>)\s*$", code):
            operands = re.findall(r"%([A-Za-z_][A-Za-z0-9_]*)\b", code.split("=", 1)[1])
            assert not set(operands) & set(int_args), f"{name}: int32 product of an argument: {code.strip()}"


@pytest.fixture(scope="module")
def reports():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True, timeout=1200, cwd=ROOT
    )
    if result.returncode != 0 and "ptxas" in result.stderr and "No such file" in result.stderr:
        pytest.skip("this triton install has no ptxas to compile with")
    assert result.returncode == 0, result.stderr[-4000:]  # a kernel that fails to compile or the int64 check raises
    return json.loads(result.stdout)


def test_every_kernel_is_compiled(reports):
    from bench.static import triton_variants

    assert [r["name"] for r in reports["variants"]] == [v.name for v in triton_variants()]
    assert sorted({r["kernel"] for r in reports["variants"]}) == reports["kernels"]


def test_variants_compile_with_their_real_launch_specialisation(reports):
    reports = reports["variants"]
    fwd = next(r for r in reports if r["name"] == "token_logprobs fwd bf16 [16384, 151936]")
    # What a launch on CUDA tensors of this shape gets: aligned pointers, V (151936 = 16 * 9496)
    # hinted, the unit vocab stride and [N, V]'s single row per outer index made constexpr.
    for expected in (
        "logits_ptr:*bf16[divisibility=16]",
        "vocab:i32[divisibility=16]",
        "vocab_stride=1",
        "rows_per_outer=1",
        "GROUP=8",
    ):
        assert expected in fwd["signature"], fwd["signature"]
    odd = next(r for r in reports if r["name"] == "token_logprobs fwd bf16 [16384, 50257]")
    assert "vocab:i32," in odd["signature"] + ",", odd["signature"]  # no hint on an odd V


def test_static_budgets_hold(reports):
    """No spills; on the log-prob
    kernels the SASS instructions per logit of the hot loop within budget and, for bf16 rows
    that allow it, only 128-bit loads there."""
    from bench.static import BUDGETS

    reports = reports["variants"]
    budgeted = {r["name"]: r["instructions_per_element"] for r in reports if r["budget"] is not None}
    assert {r["budget"] for r in reports if r["budget"] is not None} == set(BUDGETS.values())
    assert any("bf16 [16384, 151936]" in name for name in budgeted)
    failures = [f"{r['name']}: {p}" for r in reports for p in r["problems"]]
    assert not failures, "\n".join(failures)


def test_int64_check_catches_an_int32_stride_product():
    """The TTIR check itself: an int32 ``t * stride`` (the bug it guards against) is reported."""
    ttir = (
        "  %t = tt.make_range {end = 1024 : i32, start = 0 : i32} : tensor<1024xi32>\n"
        "  %p = arith.muli %t, %mask_stride1 : tensor<1024xi32> loc(#loc1)\n"
        "  %q = tt.addptr %mask_ptr, %p : tensor<1024x!tt.ptr<i1>>, tensor<1024xi32> loc(#loc2)\n"
    )
    with pytest.raises(AssertionError, match="int32 product"):
        _check_int64_addressing("k", ttir.replace("tt.addptr", "tt.nothing"), ["mask_stride1"])
    with pytest.raises(AssertionError, match="32-bit address offset"):
        _check_int64_addressing("k", ttir, [])


if __name__ == "__main__":
    import dataclasses

    from bench import static

    out = []
    for report in static.analyse_triton(keep_ttir=True):
        _check_int64_addressing(report.name, report.ttir, report.int_args)
        out.append(dataclasses.asdict(report) | {"problems": report.problems()})
    print(json.dumps({"variants": out, "kernels": static.triton_kernels()}))
