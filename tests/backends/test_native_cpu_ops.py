"""What only the native backend's CPU kernels have to show: registration and availability,
gradients of only the inputs that ask (the backward operators' output_mask), mixed input
dtypes, the reference's gradient conventions at clamps and ties, fast_exp's underflow, and
bitwise determinism across thread counts.  Values, gradients, layouts, poison, edge shapes,
gradcheck, opcheck and torch.compile of every op are tests/test_conformance.py's matrix."""

import inspect
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_native_common import NATIVE, policy_inputs, random_holes_mask, random_mask, requires_native

import ppo_fast as pf
from ppo_fast.backends import reference
from ppo_fast.spec import KL_ESTIMATORS

pytestmark = requires_native
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


def _native():
    return NATIVE.module


# --------------------------------------------------------------------------- registration


def test_cuda_kernels_registered_iff_built_with_cuda():
    native = _native()
    built = native.built_with_cuda()
    # Without CUDA no operator has a CUDA kernel; an op served on CUDA has its forward and backward there.
    for operator in native.OPERATORS:
        if not built:
            assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"ppo_fast::{operator}", "CUDA"), operator
    for op, devices in native.SUPPORTED.items():
        for operator in {op, f"{op}_backward"} & set(native.OPERATORS) if "cuda" in devices else ():
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"ppo_fast::{operator}", "CUDA"), operator
    assert ("cuda" in native.SUPPORTED["clipped_policy_loss"]) == built
    assert native.SUPPORTED["gae"] == {"cpu"}


@pytest.mark.skipif(
    not NATIVE.available or not NATIVE.module.built_with_cuda(), reason="the extension was built without CUDA kernels"
)
def test_the_build_holds_code_for_the_cuda_architectures_it_reports():
    import ppo_fast._C as C

    from bench.static import _nvidia_tool

    cuobjdump = _nvidia_tool("cuobjdump")  # triton's own, else one on PATH
    if shutil.which(cuobjdump) is None:
        pytest.skip("no cuobjdump: neither triton's nor one on PATH")
    held = {}
    for flag, kind in (("--list-elf", "sm"), ("--list-ptx", "compute")):
        listing = subprocess.run([cuobjdump, flag, C.__file__], capture_output=True, text=True, check=True).stdout
        for unit, arch in re.findall(r"file\s+\d+: (\w+)\.sm_(\w+)\.(?:cubin|ptx)", listing):
            held.setdefault(unit, set()).add(f"{kind}_{arch}")
    assert set(held) == {"policy_loss", "value_loss"}, held
    for unit, archs in held.items():
        assert archs == set(_native().cuda_archs()), (unit, archs)


def test_autograd_of_every_op_but_the_fused_heads_is_in_cpp():
    """A Python autograd kernel (torch.library.register_autograd) costs tens of microseconds a call:
    every operator has a C++ one (csrc/autograd/<op>.cpp), the packed layout's segmented ops (``*_varlen``)
    included, but the fused heads'."""
    python_autograd = {
        name for name in _native().OPERATORS if name.startswith("linear_") or name == "bool_mask"
    }  # bool_mask: a mask conversion, not differentiable
    for name in _native().OPERATORS:
        dump = torch._C._dispatch_dump(f"ppo_fast::{name}")
        in_cpp = any("csrc/autograd/" in line for line in dump.splitlines() if line.startswith("Autograd"))
        assert in_cpp == (name not in python_autograd), (name, dump)


def test_functions_take_the_reference_signature():
    for op in _native().SUPPORTED:
        native_params = inspect.signature(_native().FUNCTIONS[op]).parameters
        # rows: the reference's sequence-level modes' packed segments (its own varlen path), not an argument
        reference_params = [p for p in inspect.signature(reference.FUNCTIONS[op]).parameters if p != "rows"]
        assert list(native_params) == reference_params, op


def test_unavailable_with_the_import_error_when_the_extension_is_missing():
    # A fresh interpreter in which importing ppo_fast._C fails (a None entry in sys.modules).
    script = (
        "import sys; sys.modules['ppo_fast._C'] = None\n"
        "from ppo_fast.backends import backend_info\n"
        "info = backend_info('native'); print(info.available); print(info.detail)\n"
    )
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=root)
    available, detail = run.stdout.splitlines()
    assert available == "False"
    assert "ppo_fast._C could not be imported" in detail and "None in sys.modules" in detail


# --------------------------------------------------------------------------- gradients only where asked


def _kl_inputs(shape, dtype=F32, ref_dtype=None):
    """log-probs and reference log-probs with log-ratios beyond k3's clamps and exact zeros (abs)."""
    logprobs = -3 * torch.rand(shape)
    ref = logprobs + torch.randn(shape)
    for i, shift in enumerate([25.0, -25.0, -5.0, 5.0, 0.0]):  # k3: inner clamps, inside / beyond the outer; abs: 0
        ref.view(-1)[i] = logprobs.view(-1)[i] + shift
    return logprobs.to(dtype), ref.to(ref_dtype or dtype)


def _value_inputs(shape):
    values = torch.randn(shape)
    return values, values + 0.3 * torch.randn(shape), torch.randn(shape)


# op -> (inputs of a shape, call(functions, inputs, mask)): every floating input can be differentiated.
GRAD_OPS = {
    "clipped_policy_loss": (
        lambda s: (*policy_inputs(s, F32), torch.rand(s, dtype=F16)),
        lambda f, x, m: f["clipped_policy_loss"](*x[:3], m, x[3], **CLIP, dual_clip=2.0, agg="seq-mean-token-mean"),
    ),
    "value_loss": (_value_inputs, lambda f, x, m: f["value_loss"](*x, m, 0.2, "token-mean")),
    "kl_estimate": (lambda s: _kl_inputs(s), lambda f, x, m: (f["kl_estimate"](*x, "k3"),)),
    "kl_penalized_rewards": (
        lambda s: (torch.randn(s[0]), *_kl_inputs(s)),
        lambda f, x, m: f["kl_penalized_rewards"](*x, m, 0.3, "k2"),
    ),
    "gae": (lambda s: (torch.randn(s), torch.randn(s)), lambda f, x, m: f["gae"](*x, m, 0.99, 0.95)),
}
# (op, which inputs require grad, which output is differentiated: None for every differentiable one)
GRAD_CASES = [
    *[("clipped_policy_loss", r, 0) for r in ("0100", "0010", "0001", "1010", "0111", "1111")],
    *[("value_loss", r, 0) for r in ("010", "001", "101", "011")],
    ("kl_estimate", "01", 0),
    *[("kl_penalized_rewards", "111", out) for out in (0, 1)],
    *[("gae", r, out) for r, out in (("01", 0), ("11", 0), ("11", 1))],
]


def _grads(functions, op, inputs, mask, requires, output):
    xs = [x.detach().clone().requires_grad_(r == "1") for x, r in zip(inputs, requires)]
    outputs = GRAD_OPS[op][1](functions, xs, mask)
    used = outputs[:1] if op.endswith("loss") else outputs if output is None else outputs[output : output + 1]
    total = sum((o * torch.linspace(-1, 2, o.numel()).view(o.shape)).sum() for o in used)
    return outputs, torch.autograd.grad(total, [x for x in xs if x.requires_grad], allow_unused=True)


@pytest.mark.parametrize("op, requires, output", GRAD_CASES, ids=lambda v: str(v))
def test_gradients_only_of_the_inputs_that_ask(op, requires, output):
    """The backward operator gets an output_mask of the inputs that require grad (and None for
    an output without gradient): each gradient that of the reference, in its input's dtype."""
    shape = (3, 11)
    inputs, mask = GRAD_OPS[op][0](shape), random_holes_mask(shape)
    outputs, grads = _grads(_native().FUNCTIONS, op, inputs, mask, requires, output)
    _, expected = _grads(reference.FUNCTIONS, op, inputs, mask, requires, output)
    if op.endswith("loss"):  # the stats are not differentiable
        assert outputs[0].requires_grad and not any(o.requires_grad for o in outputs[1:])
    for g, e, x in zip(grads, expected, [x for x, r in zip(inputs, requires) if r == "1"]):
        if e is None:  # no path to this input (the scores, from the KL)
            assert g is None or torch.count_nonzero(g) == 0
            continue
        assert g.dtype == x.dtype and g.shape == x.shape
        torch.testing.assert_close(g, e, **({"rtol": 1e-5, "atol": 1e-6} if x.dtype == F32 else {}))


def test_backward_operators_skip_unrequested_gradients():
    shape = (3, 5)
    ops = torch.ops.ppo_fast
    logprobs, old, adv = policy_inputs(shape, F32)
    mask, row_scale, one = random_mask(shape), torch.ones(3), torch.tensor(1.0)
    grads = ops.clipped_policy_loss_backward(
        one, logprobs, old, adv, mask, None, row_scale, 0.2, 0.2, None, [False, True, False, True]
    )
    assert [g.numel() for g in grads] == [0, 15, 0, 0]  # no weights: no weight gradient either
    grads = ops.value_loss_backward(one, logprobs, old, adv, mask, row_scale, 0.2, [False, False, True])
    assert [g.numel() for g in grads] == [0, 0, 15]
    grad_logp, grad_ref = ops.kl_estimate_backward(torch.ones(shape), logprobs, old, "k2", [False, True])
    assert grad_logp.numel() == 0 and grad_ref.shape == shape
    grads = ops.kl_penalized_rewards_backward(
        torch.ones(shape), None, logprobs, old, mask, 0.1, "k1", F16, [True, False, False]
    )
    assert grads[0].shape == (3,) and grads[0].dtype == F16 and grads[1].numel() == grads[2].numel() == 0
    grad_rewards, grad_values = ops.gae_backward(None, torch.ones(shape), mask, 1.0, 1.0, F32, BF16, [False, True])
    assert grad_rewards.numel() == 0 and grad_values.dtype == BF16
    # No upstream gradient at all: zero gradients.
    grads = ops.kl_penalized_rewards_backward(None, None, logprobs, old, mask, 0.1, "k3", F32, [True] * 3)
    assert all(torch.count_nonzero(g) == 0 for g in grads)


# (op, input dtypes, the output's dtype): one compute dtype for all inputs but the scores
MIXED_DTYPES = [
    ("clipped_policy_loss", (BF16, F32, F16, F64), F64),
    ("clipped_policy_loss", (BF16, F32, F16, F16), F32),
    ("kl_penalized_rewards", (F64, BF16, F32), F32),  # the scores do not set the compute dtype
    ("gae", (F64, F32), F64),
]


@pytest.mark.parametrize("op, dtypes, out_dtype", MIXED_DTYPES, ids=lambda v: str(v))
def test_mixed_input_dtypes_give_each_gradient_its_dtype(op, dtypes, out_dtype):
    shape = (4, 19)
    inputs = [x.to(d) for x, d in zip(GRAD_OPS[op][0](shape), dtypes)]
    mask = random_holes_mask(shape)
    outputs, grads = _grads(_native().FUNCTIONS, op, inputs, mask, "1" * len(inputs), None)
    expected_outputs, expected = _grads(reference.FUNCTIONS, op, inputs, mask, "1" * len(inputs), None)
    assert outputs[0].dtype == out_dtype
    for o, e in zip(outputs, expected_outputs):  # the loss and its stats, or both results
        torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-6, check_dtype=False)  # the reference's rewards: float64
    assert [g.dtype for g in grads] == list(dtypes)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, **({"rtol": 1e-5, "atol": 1e-6} if g.dtype in (F32, F64) else {}))


# --------------------------------------------------------------------------- clamps and ties


@pytest.mark.parametrize("kl_estimator", KL_ESTIMATORS)
def test_kl_estimate_gradient_conventions(kl_estimator):
    # abs: sign(0) = 0; k3: no gradient beyond either clamp; k1: -1 to the reference.
    logprobs, ref = torch.zeros(5), torch.tensor([0.0, 25.0, -25.0, 5.0, -0.5])
    x, r = logprobs.clone().requires_grad_(True), ref.clone().requires_grad_(True)
    grad_logp, grad_ref = torch.autograd.grad(_native().FUNCTIONS["kl_estimate"](x, r, kl_estimator).sum(), (x, r))
    log_ratio = logprobs - ref
    expected = {
        "k1": torch.ones(5),
        "k2": log_ratio,
        "abs": torch.sign(log_ratio),
        "k3": torch.where(torch.tensor([True, False, False, False, True]), 1 - torch.exp(-log_ratio), 0.0),
    }[kl_estimator]
    torch.testing.assert_close(grad_logp, expected)
    torch.testing.assert_close(grad_ref, -expected)


def _column(*values, dtype=F64):
    return torch.tensor(values, dtype=dtype).view(-1, 1)


def test_policy_gradient_zero_where_clipped_clamped_or_capped():
    # Row 0: A > 0 and ratio e^1 > 1 + clip: clipped.  Row 1: |log-ratio| > 20: clamped.
    # Row 2: A < 0 and ratio e^2 > dual_clip 3: capped.  Row 3: inside the clip range.
    logprobs, adv = _column(1.0, 25.0, 2.0, 0.05, dtype=F32), _column(1, 1, -1, 2, dtype=F32)
    mask = torch.ones(4, 1, dtype=torch.bool)
    for backend in ("native", "reference"):
        logp = logprobs.clone().requires_grad_(True)
        with pf.use_backend(backend):
            loss, stats = pf.clipped_policy_loss(logp, torch.zeros(4, 1), adv, mask, dual_clip=3.0, agg="token-sum")
        (grad,) = torch.autograd.grad(loss, logp)
        torch.testing.assert_close(grad, _column(0.0, 0.0, 0.0, -2.0 * math.exp(0.05), dtype=F32))
        assert stats["clipfrac"].item() == pytest.approx(0.5)  # rows 0 and 1 (the clamped ratio e^20 is clipped too)
        assert stats["clipfrac_lower"].item() == pytest.approx(0.25)


CLIP = dict(clip_eps_low=0.2, clip_eps_high=0.2)


def _all_grads(op, inputs, mask, *args, backends=(_native, lambda: reference), **options):
    """The loss's gradient w.r.t. every input (but None), native's, equal to the reference's."""
    results = []
    for backend in backends:
        functions = backend().FUNCTIONS
        xs = [x if x is None else x.clone().requires_grad_(True) for x in inputs]
        loss = functions[op](*xs[:3], mask, *xs[3:], *args, **options)[0]
        results.append(torch.autograd.grad(loss, [x for x in xs if x is not None]))
    for g, e in zip(results[0], results[-1]):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=0)
    return results[0]


def test_policy_loss_tie_conventions_match_reference():
    # Row 0: A = 0 with the ratio clipped (unclipped == clipped: the A gradient is split).
    # Row 1: the dual-clip cap equals pg (ratio 1, dual_clip 1): minimum splits the gradient.
    # Row 2: ratio inside the clip range (unclipped == clipped).
    inputs = (
        _column(1.0, 0.0, 0.1),
        torch.zeros(3, 1, dtype=F64),
        _column(0.0, -1.0, 0.7),
        torch.full((3, 1), 0.5, dtype=F64),
    )
    grads = _all_grads(
        "clipped_policy_loss", inputs, torch.ones(3, 1, dtype=torch.bool), **CLIP, dual_clip=1.0, agg="token-sum"
    )
    e = torch.exp(torch.tensor(1.0, dtype=F64))
    torch.testing.assert_close(grads[2][0, 0], -0.5 * (e + 1.2) * 0.5)  # weight 0.5
    torch.testing.assert_close(grads[0][1, 0], torch.tensor(0.25, dtype=F64))  # half of w * -A * ratio


def test_policy_loss_log_ratio_clamp_passes_gradient_on_its_closed_range():
    # clamp(logp - old, -20, 20) passes the gradient at exactly +-20 (and not beyond).
    adv = _column(-1.0, 1.0, -1.0)  # the unclipped term wins
    inputs = (_column(20.0, -20.0, 20.5), torch.zeros(3, 1, dtype=F64), adv, None)
    mask = torch.ones(3, 1, dtype=torch.bool)
    grad_logp, grad_old, grad_adv = _all_grads(
        "clipped_policy_loss", inputs, mask, **CLIP, dual_clip=None, agg="token-sum", backends=(_native,)
    )
    ratio = torch.exp(torch.tensor([20.0, -20.0, 20.0], dtype=F64))
    torch.testing.assert_close(grad_logp[:, 0], -adv[:, 0] * ratio * torch.tensor([1.0, 1.0, 0.0], dtype=F64))
    torch.testing.assert_close(grad_old, -grad_logp)
    torch.testing.assert_close(grad_adv[:, 0], -ratio)


def test_value_loss_tie_conventions_match_reference():
    # V exactly at V_old + clip and at V_old - clip (minimum / maximum ties), V == R, V inside the range.
    inputs = (_column(0.5, -0.5, 0.25, 1.0), _column(0.0, 0.0, 0.0, 0.5), _column(2.0, -2.0, 0.25, 3.0))
    _all_grads("value_loss", inputs, torch.ones(4, 1, dtype=torch.bool), 0.5, "token-sum")


# --------------------------------------------------------------------------- token_logprobs


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_token_logprobs_exp_underflow_and_saturation(dtype):
    """Logits around the float32 exp's ends (fast_exp: 0 below about -87.68 relative to the
    row max, where the exact value is subnormal): log-probs, entropy and gradient as the
    float64 reference, in rows long enough for the vector loops and several chunks."""
    gen = torch.Generator().manual_seed(12)
    offsets = torch.tensor([0.0, -20.0, -87.0, -87.5, -87.68, -87.7, -88.03, -88.1, -100.0, -1e30])
    logits = offsets[torch.randint(0, len(offsets), (6, 2100), generator=gen)]
    logits = logits + 0.01 * torch.randn(6, 2100, generator=gen)
    logits[:, 0] = 0.5  # every row has its max away from the ends
    logits = logits.to(dtype)
    labels = torch.randint(0, 2100, (6,), generator=gen)
    labels[0] = 0
    x, x64 = logits.clone().requires_grad_(True), logits.double().requires_grad_(True)
    logp, ent = _native().FUNCTIONS["token_logprobs"](x, labels, 1.0, True, -100)
    (grad,) = torch.autograd.grad(logp.sum() + ent.sum(), x)
    ref_logp, ref_ent = reference.token_logprobs(x64, labels, 1.0, True, -100)
    (ref_grad,) = torch.autograd.grad(ref_logp.sum() + ref_ent.sum(), x64)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all() and torch.isfinite(grad).all()
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-6 if dtype == F32 else 1e-2)


# --------------------------------------------------------------------------- determinism


def test_bitwise_deterministic_across_calls_and_threads():
    ops = torch.ops.ppo_fast
    shape = (64, 700)
    logprobs, old, adv = policy_inputs(shape, F32)
    ref = _kl_inputs(shape)[1]
    mask, grad = random_holes_mask(shape), torch.randn(shape)

    def run():
        with pf.use_backend("native"):
            yield pf.clipped_policy_loss(logprobs, old, adv, mask, agg="token-mean")[0]
            yield pf.value_loss(logprobs, old, adv, mask, agg="seq-mean-token-sum")[0]
        yield from ops.kl_estimate_backward(grad, logprobs, ref, "k3", [True, True])
        yield from ops.kl_penalized_rewards_backward(grad, grad, logprobs, ref, mask, 0.1, "k2", F32, [True] * 3)
        yield from ops.gae_backward(grad, grad, mask, 0.99, 0.95, F32, F32, [True, True])

    threads = torch.get_num_threads()
    outputs = []
    try:
        for n in (threads, 1, threads):
            torch.set_num_threads(n)
            outputs.append(list(run()))
    finally:
        torch.set_num_threads(threads)
    for again in outputs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(again, outputs[0]))


# --------------------------------------------------------------------------- integer arguments at their extremes

EXTREME_CALLS = """
import sys, torch, ppo_fast
x, h, w = torch.randn(3, 11), torch.randn(3, 4), torch.randn(11, 4)
y = torch.tensor([1, 5, -100])
for k in (6, 11, 12, 2**31, 2**62, 2**63 - 1):
    for ignore in (-100, -(2**63), 2**63 - 1):
        args = (1.0, True, ignore, k)
        a = torch.ops.ppo_fast.token_logprobs(x, y, *args)[:2]
        b = torch.ops.ppo_fast.linear_token_logprobs(h, w, y, None, 1.0, 1.0, None, *args[1:])[:2]
        if k >= 11:  # top_k >= V keeps every token: the untruncated row
            for got, off in ((a, torch.ops.ppo_fast.token_logprobs(x, y, 1.0, True, ignore)[:2]),
                             (b, torch.ops.ppo_fast.linear_token_logprobs(h, w, y, None, 1.0, 1.0, None, True, ignore)[:2])):
                for g, o in zip(got, off):
                    torch.testing.assert_close(g, o, equal_nan=True)
print("ok")
"""


def test_top_k_and_ignore_index_at_their_extremes_return():
    """Direct calls with top_k and ignore_index at int64's ends: an answer (top_k >= V: the untruncated
    row), never a hang (2 * top_k overflowed, and the scan then ran 2^62 times) or a crash.  In a
    child process with a timeout, so that a hang fails this test."""
    done = subprocess.run([sys.executable, "-c", EXTREME_CALLS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
