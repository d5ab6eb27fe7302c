"""Every Triton kernel variant compiles for a Hopper GPU (sm_90), and for a B200 (sm_100), with
the specialisation a real launch gives it, its address arithmetic is 64-bit, and the static performance budgets
of ``bench.static`` hold (registers, spills, 128-bit loads, SASS instructions per logit).

``bench.static`` runs the launchers on ``meta`` tensors of the target shapes and hands each
intercepted launch to Triton's own binder, so the compiled code is the code that runs: the
divisibility-by-16 hints on pointers and ints, ints equal to 1 made constexpr, i32 for the
ints that fit.  The interpreter accepts code that the compiler rejects, so the CPU tests
alone would not catch a kernel that does not compile.  Compilation runs in a subprocess
(``python -m bench static --no-cuda --json``; conftest sets TRITON_INTERPRET=1, under which
kernels cannot be compiled), started by tests/conftest.py when collection ends, so that it runs
beside the rest of the suite; these tests run last.  With ``PPO_FAST_STATIC_REPORT=FILE`` (CI) the report is written
there, and ``python -m bench static --triton-report FILE`` prints it, compiling only the variants the fast tier's
sample left out.
"""

import pytest


@pytest.fixture(scope="module")
def reports(static_report):
    """The compile runs in the background from the start of the session (tests/conftest.py)."""
    pytest.importorskip("triton")
    from bench import static

    out, said = static_report
    if not out.exists() and "ptxas" in said and "No such file" in said:
        pytest.skip("this triton install has no ptxas to compile with")
    assert out.exists(), said[-4000:]  # a kernel that fails to compile
    return static.read_json(out)


def test_every_kernel_is_compiled(reports, static_report):
    """Every variant in the full tier (and the compat cells', ``PPO_FAST_STATIC_EVERY=1``); in the fast tier
    (``--sample``) the first variant of each kernel, set of pointer dtypes, budget and 128-bit-load
    expectation (every kernel; every budget: test_static_budgets_hold), the rest (other constexprs and
    shapes) in the full tier."""
    import os
    import re

    from bench.static import triton_kernels, triton_variants

    names, got = [v.name for v in triton_variants()], [r.name for r in reports]
    said = re.search(r"sm_90: (\d+) of (\d+) Triton variants sampled", static_report[1])
    every = "1" in (os.environ.get("PPO_FAST_FULL"), os.environ.get("PPO_FAST_STATIC_EVERY"))
    assert (said is None) == every, static_report[1][-4000:]
    if every:
        assert got == names
    else:
        assert [int(n) for n in said.groups()] == [len(got), len(names)]
        assert got == [name for name in names if name in set(got)] and len(set(got)) == len(got)  # in order, once
    assert sorted({r.kernel for r in reports}) == triton_kernels()


def test_every_kernel_also_compiles_for_blackwell(reports, static_report):
    """sm_100: every variant in the full tier; in the fast tier, of the variants compiled for sm_90, every
    one of the kernels with ``tl.dot`` and one of each other kernel and set of pointer dtypes
    (``--also-sample``: the rest differ in constexprs, which select no architecture's path)."""
    import re

    from bench.static import triton_kernels, triton_variants

    n = len(triton_variants())
    said = re.search(r"sm_100: (\d+) of (\d+) Triton variants tried compiled \((\d+) in all\)", static_report[1])
    assert said, static_report[1][-4000:]
    compiled, tried, total = map(int, said.groups())
    assert compiled == tried and total == n and len(triton_kernels()) <= tried <= n


def test_variants_compile_with_their_real_launch_specialisation(reports):
    fwd = next(r for r in reports if r.name == "token_logprobs fwd bf16 [16384, 151936]")
    # What a launch on CUDA tensors of this shape gets: aligned pointers, V (151936 = 16 * 9496)
    # hinted, the unit vocab stride and [N, V]'s single row per outer index made constexpr.
    for expected in (
        "logits_ptr:*bf16[divisibility=16]",
        "vocab:i32[divisibility=16]",
        "vocab_stride=1",
        "rows_per_outer=1",
        "GROUP=8",
    ):
        assert expected in fwd.signature, fwd.signature
    odd = next(r for r in reports if r.name == "token_logprobs fwd bf16 [16384, 50257]")
    assert "vocab:i32," in odd.signature + ",", odd.signature  # no hint on an odd V


def test_static_budgets_hold(reports):
    """No spills, 64-bit addressing; on the log-prob kernels the SASS instructions per logit of the
    hot loop within budget and, for bf16 rows that allow it, only 128-bit loads there."""
    from bench.static import BUDGETS

    budgeted = {r.name: r.instructions_per_element for r in reports if r.budget is not None}
    assert {r.budget for r in reports if r.budget is not None} == set(BUDGETS.values())
    assert any("bf16 [16384, 151936]" in name for name in budgeted)
    failures = [f"{r.name}: {p}" for r in reports for p in r.problems()]
    assert not failures, "\n".join(failures)


def test_int64_check_catches_an_int32_stride_product():
    """The TTIR check itself: an int32 ``t * stride`` (the bug it guards against) is reported."""
    from bench.static import int64_problems

    ttir = (
        "  %t = tt.make_range {end = 1024 : i32, start = 0 : i32} : tensor<1024xi32>\n"
        "  %p = arith.muli %t, %mask_stride1 : tensor<1024xi32> loc(#loc1)\n"
        "  %q = tt.addptr %mask_ptr, %p : tensor<1024x!tt.ptr<i1>>, tensor<1024xi32> loc(#loc2)\n"
    )

    (product,) = int64_problems(ttir.replace("tt.addptr", "tt.nothing"), ["mask_stride1"])
    assert product.startswith("int32 product of an argument")
    (offset,) = int64_problems(ttir, [])
    assert offset.startswith("32-bit address offset")
    assert int64_problems(ttir.replace("xi32>", "xi64>").replace(": i32", ": i64"), ["mask_stride1"]) == []
