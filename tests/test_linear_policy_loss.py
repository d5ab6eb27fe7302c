"""pf.linear_policy_loss against the two-pass composition it fuses: linear_token_logprobs, then
policy_loss plus the entropy bonus and the KL loss term, values, stats and the gradients w.r.t.
hidden, weight and bias, on every backend that serves it (chunks of whole sequences forced small)."""

from __future__ import annotations

import importlib
import zlib

import pytest
import tiers
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ppo_fast as pf
from ppo_fast.backends import serving
from ppo_fast.backends.reference import linear_policy_loss as reference_module
from ppo_fast.spec import AGG_MODES, POLICY_LOSS_MODES

FUSED = [name for name, mode in POLICY_LOSS_MODES.items() if mode.fused_head]
TWO_PASS = [name for name, mode in POLICY_LOSS_MODES.items() if not mode.fused_head]
TOLERANCE = {
    torch.float32: {"rtol": 2e-5, "atol": 2e-5},
    torch.float64: {"rtol": 1e-9, "atol": 1e-11},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-3},
    torch.float16: {"rtol": 2e-3, "atol": 1e-4},
}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """The reference's chunks and the Triton GEMM-first head's: two sequences of the cases below, so that
    every case has several (and the head's row kernels 16-wide vocabulary tiles, several a row)."""
    monkeypatch.setattr(reference_module, "CHUNK_ELEMENTS", 2 * 7 * 53)
    if "triton" in serving("linear_policy_loss_vanilla", "cpu") or torch.cuda.is_available():
        gemm_head = importlib.import_module("ppo_fast.backends.triton._gemm_head")
        plan = importlib.import_module("ppo_fast.backends._head_plan")
        for bound in ("MIN_ROWS", "MAX_ROWS"):  # every budget: chunks of two sequences
            monkeypatch.setattr(plan, bound, 2 * 7)
        monkeypatch.setattr(gemm_head, "ROW_BLOCK_V", 16)


def make_inputs(seed, *, dtype=torch.float32, dims=(5, 7, 53, 13), bias=True, weighted=False, ignore_index=-100):
    gen = torch.Generator().manual_seed(seed)
    B, T, V, H = dims
    hidden = torch.randn(B, T, H, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) / H**0.25).to(dtype).requires_grad_()
    bias = torch.randn(V, generator=gen).to(dtype).requires_grad_() if bias else None
    mask = torch.rand(B, T, generator=gen) < 0.7
    mask[0] = False  # a response without tokens
    labels = torch.randint(0, V, (B, T), generator=gen)
    labels = torch.where(torch.rand(B, T, generator=gen) < 0.15, ignore_index, labels)  # ignored valid tokens
    junk = torch.where(mask, 0.0, torch.nan)  # masked tokens of the rollout's tensors hold NaN: never read
    old = -torch.rand(B, T, generator=gen).to(dtype) - 0.1 + junk.to(dtype)
    adv = torch.randn(B, T, generator=gen).to(dtype) + junk.to(dtype)
    ref = -torch.rand(B, T, generator=gen).to(dtype) - 0.1
    weights = (torch.rand(B, T, generator=gen) + 0.5).to(dtype) if weighted else None
    return dict(
        hidden=hidden, weight=weight, bias=bias, labels=labels, old=old, adv=adv, mask=mask, ref=ref, weights=weights
    )


def mode_params(name):
    params = POLICY_LOSS_MODES[name].example_params()
    if "clip_eps_high" in {p.name for p in POLICY_LOSS_MODES[name].params}:
        params["clip_eps_high"] = 0.28
    return params


def fused(x, mode, agg, backend, **head):
    args = [x[name] for name in ("hidden", "weight", "labels", "old", "adv", "mask")]
    terms = dict(weights=x["weights"], bias=x["bias"], ref_logprobs=x["ref"], kl_coef=0.1, entropy_coef=0.01)
    with pf.use_backend(backend):
        return pf.linear_policy_loss(
            *args, loss_mode=mode, agg=agg, kl_estimator="k3", **terms, **head, **mode_params(mode)
        )


def two_pass(x, mode, agg, *, ignore_index=-100, **head):
    """The composition, on the reference backend (``head``: the LM head's temperature, scale, soft-cap)."""
    with pf.use_backend("reference"):
        labels = torch.where(x["mask"], x["labels"], ignore_index)
        logp, entropy = pf.linear_token_logprobs(
            x["hidden"], x["weight"], labels, bias=x["bias"], return_entropy=True, ignore_index=ignore_index, **head
        )
        pg_loss, stats = pf.policy_loss(
            logp, x["old"], x["adv"], x["mask"], loss_mode=mode, agg=agg, weights=x["weights"], **mode_params(mode)
        )
        entropy_mean = pf.masked_mean(entropy, x["mask"])
        if x["ref"] is None:  # no KL term (``packed_call``'s without ``ref``)
            loss = pg_loss - 0.01 * entropy_mean
            return loss, {**stats, "pg_loss": pg_loss.detach(), "entropy": entropy_mean.detach()}
        kl_loss = pf.aggregate(pf.kl_estimate(logp, x["ref"], "k3"), x["mask"], agg)
    loss = pg_loss - 0.01 * entropy_mean + 0.1 * kl_loss
    stats = {**stats, "pg_loss": pg_loss.detach(), "entropy": entropy_mean.detach(), "kl_loss": kl_loss.detach()}
    return loss, stats


def leaves(x):
    return [t for t in (x["hidden"], x["weight"], x["bias"]) if t is not None]


def check_against_two_pass(x, mode, agg, backend, dtype=torch.float32, **head):
    loss, stats = fused(x, mode, agg, backend, **head)
    grads = torch.autograd.grad(loss * 1.7, leaves(x))  # the backward scales by the incoming gradient
    if mode in TWO_PASS:
        torch.manual_seed(0)
    want_loss, want_stats = two_pass(x, mode, agg, **head)
    want_grads = torch.autograd.grad(want_loss * 1.7, leaves(x))
    tol = TOLERANCE[dtype]
    assert loss.dtype == want_loss.dtype and loss.shape == ()
    torch.testing.assert_close(loss, want_loss, **tol)
    assert stats.keys() == want_stats.keys()
    for name, want in want_stats.items():
        stat_tol = TOLERANCE[torch.float32] if want.dtype == torch.float32 else tol  # clip fractions are float32
        torch.testing.assert_close(stats[name], want, **stat_tol, msg=lambda m: f"stat {name}: {m}")
        assert not stats[name].requires_grad
    for name, got, want in zip(("hidden", "weight", "bias"), grads, want_grads):
        assert got.dtype == want.dtype and got.shape == want.shape
        scale = float(want.abs().max()) if want.numel() else 1.0
        torch.testing.assert_close(
            got, want, rtol=tol["rtol"], atol=tol["atol"] * max(scale, 1.0), msg=lambda m: f"grad of {name}: {m}"
        )


def cases(modes):
    for mode in modes:
        op = POLICY_LOSS_MODES[mode].linear_op or POLICY_LOSS_MODES[mode].op
        for backend in serving(op, "cpu"):
            yield pytest.param(mode, backend, id=f"{mode}-{backend}")


def rotated(options, ids, modes=FUSED, triton_share=None):
    """Every mode x backend x option; the fast tier one option per mode x backend, each in turn.  With
    ``triton_share`` k (of 3), the interpreted Triton (seconds a case) takes every third mode from the
    k-th, each with another option: the three tests that pass 0, 1 and 2 take each mode there once among
    them (one kernel: the modes differ in its terms, which tests/test_policy_terms.py checks mode by mode)."""
    for i, mode in enumerate(modes):
        for b, case in enumerate(cases([mode])):
            for j, (option, name) in enumerate(zip(options, ids)):
                fast = j == (i + b) % len(options)
                if triton_share is not None and case.values[1] == "triton":
                    fast = i % 3 == triton_share and j == i // 3 % len(options)
                yield tiers.case(*case.values, option, fast=fast, id=f"{case.id}-{name}")


@pytest.mark.parametrize("mode, backend, agg", list(rotated(AGG_MODES, AGG_MODES, triton_share=0)))
def test_every_mode_and_agg_equals_the_two_pass_composition(mode, backend, agg):
    check_against_two_pass(make_inputs(zlib.crc32(f"{mode}-{agg}".encode()), weighted=True), mode, agg, backend)


HEAD_OPTIONS = [
    {"temperature": 0.6},
    {"temperature": 1.3, "logit_scale": 0.7, "logit_softcap": 3.0},
    {"ignore_index": 5},  # a pad id inside [0, V): its tokens are ignored
]


@pytest.mark.parametrize(
    "mode, backend, head", list(rotated(HEAD_OPTIONS, ["temperature", "scale-softcap", "pad-id"], triton_share=1))
)
def test_head_options_equal_the_two_pass_composition(mode, backend, head):
    x = make_inputs(7, bias=False, ignore_index=head.get("ignore_index", -100))
    check_against_two_pass(x, mode, "token-mean", backend, **head)


TRUNCATIONS = [
    {"top_k": 4, "temperature": 0.8},
    {"top_p": 0.7, "logit_scale": 0.7, "logit_softcap": 3.0},
    {"min_p": 0.2, "top_p": 0.9},
]


@pytest.mark.parametrize(
    "mode, backend, head", list(rotated(TRUNCATIONS, ["top_k", "top_p-softcap", "min_p-top_p"], triton_share=2))
)
def test_truncation_equals_the_two_pass_composition(mode, backend, head):
    """The sampler's top_k / top_p / min_p: the one pass keeps the kept sets of linear_token_logprobs'.
    The sampled tokens are the rows' most likely ones (a token outside the kept set could not have
    been sampled: its log-prob is -inf)."""
    x = make_inputs(zlib.crc32(f"{mode}-{sorted(head)}".encode()))
    with torch.no_grad():
        x["labels"] = (x["hidden"] @ x["weight"].T + x["bias"]).argmax(-1)
    check_against_two_pass(x, mode, "token-mean", backend, **head)


DTYPES = [torch.float64, torch.bfloat16, torch.float16]


@pytest.mark.parametrize(
    "mode, backend, dtype", list(rotated(DTYPES, [str(d)[6:] for d in DTYPES], ["vanilla", "gspo", "geo_mean", "dro"]))
)
def test_dtypes_equal_the_two_pass_composition(mode, backend, dtype):
    check_against_two_pass(make_inputs(11, dtype=dtype), mode, "seq-mean-token-mean", backend, dtype)


@pytest.mark.parametrize("mode", TWO_PASS)
def test_batch_wide_selection_modes_take_the_two_pass_path(mode):
    assert not pf.policy_loss_modes()[mode].fused_head and pf.policy_loss_modes()[mode].linear_op is None
    x = make_inputs(3)
    torch.manual_seed(0)  # clip_cov draws the tokens it cuts
    check_against_two_pass(x, mode, "token-mean", "auto")


@pytest.mark.parametrize("mode, backend", list(cases(["vanilla", "gspo"])))
def test_without_gradients_the_same_loss(mode, backend):
    x = make_inputs(5)
    with torch.no_grad():
        loss, stats = fused(x, mode, "token-mean", backend)
    want, want_stats = fused(x, mode, "token-mean", backend)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, want.detach())
    torch.testing.assert_close(stats, want_stats)


@pytest.mark.parametrize("mode, backend", list(cases(["vanilla"])))
def test_everything_masked_gives_zero_loss_and_gradients(mode, backend):
    x = make_inputs(2)
    x["mask"] = torch.zeros_like(x["mask"])
    loss, stats = fused(x, mode, "token-mean", backend)
    grads = torch.autograd.grad(loss, leaves(x))
    assert float(loss.detach()) == 0.0 and all(float(v) == 0.0 for v in stats.values())
    assert all(torch.count_nonzero(g) == 0 for g in grads)


class CountProducts(TorchDispatchMode):
    PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "matmul"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.__name__.split(".")[0] in self.PRODUCTS
        return func(*args, **(kwargs or {}))


def test_reference_takes_three_products_per_chunk():
    """The reference is a plain composition over chunks (so it differentiates twice): the logits'
    product per chunk in the forward, d_hidden's and d_weight's in the backward."""
    x = make_inputs(4)  # 5 sequences, 2 per chunk: 3 chunks
    with CountProducts() as forward:
        loss, _ = fused(x, "vanilla", "token-mean", "reference")
    with CountProducts() as backward:
        loss.backward()
    assert (forward.count, backward.count) == (3, 3 * 2)


def test_kl_loss_only_with_ref_logprobs():
    x = make_inputs(6)
    loss, stats = pf.linear_policy_loss(x["hidden"], x["weight"], x["labels"], x["old"], x["adv"], x["mask"])
    assert "kl_loss" not in stats and set(stats) == {"clipfrac", "clipfrac_lower", "approx_kl", "pg_loss", "entropy"}
    torch.testing.assert_close(loss.detach(), stats["pg_loss"])


@pytest.mark.parametrize(
    "mode, backend",
    [tiers.case(*p.values, fast=p.values[1] == "native", id=p.id) for p in cases(["vanilla", "gspo"])],
)  # fast tier: the native kernel's chunks
def test_many_chunks_of_a_wide_vocabulary(mode, backend):
    """A vocabulary wide enough that the native kernel's chunks hold 64 tokens (GSPO: one whole
    row of 40 each), so that the chunk boundaries and the gradients' accumulation are crossed."""
    x = make_inputs(9, dims=(4, 40, 131_072, 5), weighted=True)
    check_against_two_pass(x, mode, "seq-mean-token-sum", backend, logit_softcap=4.0)


@pytest.mark.parametrize("mode, backend", list(cases(["vanilla"])))
def test_backward_twice_through_one_graph(mode, backend):
    """retain_graph: what autograd returns is the caller's (a second backward with another incoming
    gradient leaves the first's tensors as they were), and each backward into ``.grad`` adds its own share."""
    x = make_inputs(8)
    loss, _ = fused(x, mode, "token-mean", backend)
    first = torch.autograd.grad(loss, leaves(x), retain_graph=True)
    kept = [g.clone() for g in first]
    again = torch.autograd.grad(loss * 3.0, leaves(x), retain_graph=True)
    for g, k, a in zip(first, kept, again):
        assert g is not a and g.data_ptr() != a.data_ptr()
        torch.testing.assert_close(g, k, rtol=0, atol=0)
        torch.testing.assert_close(a, 3.0 * k)
    loss.backward(retain_graph=True)
    (loss * 3.0).backward(retain_graph=True)
    (loss * -0.5).backward()
    for t, k in zip(leaves(x), kept):
        torch.testing.assert_close(t.grad, 3.5 * k)


@pytest.fixture
def seven_row_plans(monkeypatch):
    """``(_head_plan, _gemm_head)`` with the loss's plans bounded to 7..35 rows in steps of 7 (a float32
    accumulator from 35 rows); skips where the Triton backend does not serve the one pass."""
    if "triton" not in serving("linear_policy_loss_vanilla", "cpu"):
        pytest.skip("the Triton backend does not serve the one pass here")
    plan = importlib.import_module("ppo_fast.backends._head_plan")
    for name, value in (("MIN_ROWS", 7), ("MAX_ROWS", 35), ("ROW_STEP", 7), ("F32_ACC_MIN_ROWS", 35)):
        monkeypatch.setattr(plan, name, value)
    return plan, importlib.import_module("ppo_fast.backends.triton._gemm_head")


@pytest.mark.parametrize("budget, rows, narrow", [(0.0, 7, True), (1.8, 21, True), (3.2, 35, False)])
def test_the_triton_loss_chunks_as_its_memory_budget_plans(monkeypatch, seven_row_plans, budget, rows, narrow):
    """The Triton one pass takes its chunk rows and d_weight's accumulator from ``_head_plan.plan`` within
    ``MEMORY_BUDGET`` (bounds 7..35 rows in steps of 7, sequences of 7, bf16: 5 x 7 rows, V=53, H=13): the
    products' rows and the accumulator's dtype follow the budget, and the loss and gradients still equal
    the two passes'.  A chunk of r rows holds 290 r + 212 bytes (float32 logits and d_hidden rows, the
    padded hidden rows, d_bias), a float32 accumulator 1378 more; the bf16 logits are 3710 bytes.  0.0:
    nothing fits, the smallest plan; 1.8 (6678 bytes): 21 rows (6302; 28 rows: 8332); 3.2 (11872): all
    35 rows and a float32 accumulator (11740)."""
    plan, gemm_head = seven_row_plans
    monkeypatch.setattr(plan, "MEMORY_BUDGET", budget)
    seen = {"rows": set(), "narrow": set()}
    chunk_logits, gradients = gemm_head.chunk_logits, gemm_head.Gradients

    def spy_chunk(*args, rows, **kwargs):
        seen["rows"].add(rows)
        return chunk_logits(*args, rows=rows, **kwargs)

    class SpyGradients(gradients):
        def __init__(self, *args, narrow=False, **kwargs):
            seen["narrow"].add(narrow)
            super().__init__(*args, narrow=narrow, **kwargs)

    monkeypatch.setattr(gemm_head, "chunk_logits", spy_chunk)
    monkeypatch.setattr(gemm_head, "Gradients", SpyGradients)
    x = make_inputs(11, dtype=torch.bfloat16)
    check_against_two_pass(x, "vanilla", "token-mean", "triton", torch.bfloat16)
    assert seen == {"rows": {rows}, "narrow": {narrow}}


# Five chunks of 7 tokens both ways (two pairs and one alone): 5 sequences of 7 padded, 33 tokens packed.
PAIRED_LENGTHS = [7, 0, 6, 5, 7, 2, 6]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_triton_loss_pairs_its_chunks_d_weight_products(monkeypatch, seven_row_plans, packed):
    """A paired plan (``HeadPlan.pair``, forced small: 7-row chunks, bf16, the ridge at 14 rows, 100% budget):
    one d_weight product of 14 rows a pair and one of 7 for the odd fifth chunk; against the unpaired plan
    of the same chunks the loss, stats, d_hidden and d_bias are bitwise equal (only d_weight's summation
    order differs), and all of them (d_weight too) equal float64's within bf16's tolerance, d_weight's error
    no larger than the unpaired plan's.  Ignored labels, masked tokens and an empty sequence included."""
    plan, gemm_head = seven_row_plans
    monkeypatch.setattr(plan, "MEMORY_BUDGET", 1.0)
    x = make_inputs(23, dtype=torch.bfloat16, dims=(7 if packed else 5, 7, 53, 13), weighted=True)
    valid = None
    if packed:
        valid = torch.arange(7)[None, :] < torch.tensor(PAIRED_LENGTHS)[:, None]
        x["mask"] = x["mask"] & valid
    products, addmm = [], gemm_head._addmm_

    def spy_addmm(out, a, b):
        if out.shape == x["weight"].shape:  # d_weight's products: their rows
            products.append(a.shape[1])
        addmm(out, a, b)

    def result(x, backend="triton"):
        loss, stats = packed_call(x, valid, "vanilla", "token-mean", backend)
        return loss.detach(), stats, torch.autograd.grad(loss * 1.7, leaves(x))

    monkeypatch.setattr(gemm_head, "_addmm_", spy_addmm)
    monkeypatch.setattr(plan, "RIDGE_FLOPS_PER_BYTE", 7.0)  # a bf16 d_weight product below 14 rows: pairs
    got = result(x)
    assert products == [14, 14, 7]
    monkeypatch.setattr(plan, "RIDGE_FLOPS_PER_BYTE", 3.5)  # 7 rows reach the ridge: unpaired
    products.clear()
    unpaired = result(x)
    assert products == [7] * 5
    (loss, stats, grads), (want_loss, want_stats, want_grads) = got, unpaired
    assert torch.equal(loss, want_loss) and stats.keys() == want_stats.keys()
    assert all(torch.equal(stats[k], want_stats[k]) for k in stats)
    assert torch.equal(grads[0], want_grads[0]) and torch.equal(grads[2], want_grads[2])  # d_hidden, d_bias
    assert not torch.equal(grads[1], want_grads[1])  # d_weight: summed in another order
    wide = {
        k: v if v is None or not v.is_floating_point() else v.detach().double().requires_grad_() for k, v in x.items()
    }
    oracle = result(wide, "reference")
    assert_result_close(got, oracle, TOLERANCE[torch.bfloat16], "paired vs float64")
    assert_result_close(unpaired, oracle, TOLERANCE[torch.bfloat16], "unpaired vs float64")
    # d_weight's error against float64 as a whole: the pairs' bf16 roundings (three sums rounded, not five)
    # no worse than the unpaired plan's, where a chunk's product lost or misplaced is many times it
    errors = [float((r[2][1].double() - oracle[2][1]).norm()) for r in (got, unpaired)]
    assert errors[0] <= 1.5 * errors[1], errors


def test_the_triton_loss_pairs_only_chunks_of_the_same_rows(monkeypatch):
    """GSPO on packed sequences (bf16, chunks of whole sequences, 7-row plan paired): chunks of 6, 5 (padded
    to 6), 17, 9 and 20 rows; the first two pair (one product of 12 rows), the 17- and 9-row chunks, whose
    padded rows differ, add a product each, the last alone; the loss, stats, d_hidden and d_bias bitwise
    the unpaired plan's and d_weight's error against float64 no larger than the unpaired plan's."""
    if "triton" not in serving("linear_policy_loss_gspo", "cpu"):
        pytest.skip("the Triton backend does not serve the one pass here")
    plan = importlib.import_module("ppo_fast.backends._head_plan")
    gemm_head = importlib.import_module("ppo_fast.backends.triton._gemm_head")
    monkeypatch.setattr(plan, "MEMORY_BUDGET", 1.0)
    x = make_inputs(29, dtype=torch.bfloat16, dims=(8, 20, 53, 13), weighted=True)
    valid = torch.arange(20)[None, :] < torch.tensor([5, 1, 3, 2, 17, 9, 20, 0])[:, None]
    x["mask"] = x["mask"] & valid
    products, addmm = [], gemm_head._addmm_

    def spy_addmm(out, a, b):
        if out.shape == x["weight"].shape:
            products.append(a.shape[1])
        addmm(out, a, b)

    def result(x, pair, backend="triton"):
        monkeypatch.setattr(gemm_head, "head_plan", lambda *a, **k: plan.HeadPlan(7, 2, pair))
        products.clear()
        loss, stats = packed_call(x, valid, "gspo", "seq-mean-token-mean", backend)
        return loss.detach(), stats, torch.autograd.grad(loss * 1.7, leaves(x))

    monkeypatch.setattr(gemm_head, "_addmm_", spy_addmm)
    got = result(x, True)
    assert products == [12, 17, 9, 20]
    unpaired = result(x, False)
    assert products == [6, 6, 17, 9, 20]
    assert torch.equal(got[0], unpaired[0]) and all(torch.equal(got[1][k], unpaired[1][k]) for k in got[1])
    assert torch.equal(got[2][0], unpaired[2][0]) and torch.equal(got[2][2], unpaired[2][2])
    wide = {
        k: v if v is None or not v.is_floating_point() else v.detach().double().requires_grad_() for k, v in x.items()
    }
    oracle = result(wide, False, "reference")
    assert_result_close(got, oracle, TOLERANCE[torch.bfloat16], "paired vs float64")
    errors = [float((r[2][1].double() - oracle[2][1]).norm()) for r in (got, unpaired)]
    assert errors[0] <= 1.5 * errors[1], errors


def test_the_triton_loss_pairs_only_where_its_product_rows_pairs_fit(monkeypatch):
    """A paired 7-row plan on padded sequences of 20 tokens: every chunk is one sequence, 20 rows, whose
    pairs would hold 9172 bytes beyond the 6360 of a 100% budget (one unpaired chunk: 6012): unpaired."""
    if "triton" not in serving("linear_policy_loss_vanilla", "cpu"):
        pytest.skip("the Triton backend does not serve the one pass here")
    plan = importlib.import_module("ppo_fast.backends._head_plan")
    gemm_head = importlib.import_module("ppo_fast.backends.triton._gemm_head")
    monkeypatch.setattr(plan, "MEMORY_BUDGET", 1.0)
    monkeypatch.setattr(gemm_head, "head_plan", lambda *a, **k: plan.HeadPlan(7, 2, True))
    assert plan.pair_fits(3 * 20, 13, 53, 7) and not plan.pair_fits(3 * 20, 13, 53, 20)
    products, addmm = [], gemm_head._addmm_
    x = make_inputs(31, dtype=torch.bfloat16, dims=(3, 20, 53, 13))

    def spy_addmm(out, a, b):
        if out.shape == x["weight"].shape:
            products.append(a.shape[1])
        addmm(out, a, b)

    monkeypatch.setattr(gemm_head, "_addmm_", spy_addmm)
    loss, _ = packed_call(x, None, "vanilla", "token-mean", "triton")
    torch.autograd.grad(loss, leaves(x))
    assert products == [20, 20, 20]


# Packed sequences (cu_seqlens): odd lengths, an empty one and a single token, 7 tokens at most (make_inputs' T).
PACKED_LENGTHS = [7, 0, 1, 5, 7, 2, 3]
PACKED_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def packed_cases():
    """Each fused kind (token-level, GSPO, GMPO) x backend, the aggregation and dtype in turn (no bfloat16
    on the Triton interpreter, whose bfloat16 arithmetic is wrong on the CPU)."""
    for i, mode in enumerate(["vanilla", "gspo", "geo_mean", "sapo", "dppo_kl"]):
        for b, case in enumerate(sorted(cases([mode]), key=lambda c: c.values[1] != "native")):  # C++ first
            agg, dtype = AGG_MODES[(i + b + 3) % len(AGG_MODES)], PACKED_DTYPES[(i + 2 * b) % len(PACKED_DTYPES)]
            if case.values[1] == "triton" and dtype == torch.bfloat16:
                dtype = torch.float16
            yield pytest.param(*case.values, agg, dtype, id=f"{case.id}-{agg}-{str(dtype)[6:]}")


def packed_call(x, valid, mode, agg, backend):
    """``fused`` (a KL term where ``x`` has ``ref``) on the valid tokens of ``x`` packed (``[N, H]`` and
    ``[N]``), with their ``cu_seqlens``; ``valid`` None: on ``x`` itself, padded."""
    packed, layout = x, {}
    if valid is not None:
        packed = {k: v if k in ("weight", "bias") or v is None else v[valid] for k, v in x.items()}
        lengths = valid.sum(-1)
        cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
        layout = dict(cu_seqlens=cu_seqlens, max_seqlen=int(lengths.max()))
    args = [packed[name] for name in ("hidden", "weight", "labels", "old", "adv", "mask")]
    kl = 0.0 if x["ref"] is None else 0.1
    terms = dict(weights=packed["weights"], bias=x["bias"], ref_logprobs=packed["ref"], kl_coef=kl, entropy_coef=0.01)
    with pf.use_backend(backend):
        return pf.linear_policy_loss(*args, loss_mode=mode, agg=agg, **terms, **mode_params(mode), **layout)


def assert_result_close(got, want, tol, what):
    (loss, stats, grads), (want_loss, want_stats, want_grads) = got, want
    torch.testing.assert_close(loss, want_loss.to(loss.dtype), **tol, msg=lambda m: f"{what} loss: {m}")
    assert stats.keys() == want_stats.keys()
    for name, value in want_stats.items():
        stat_tol = TOLERANCE[torch.float32] if stats[name].dtype == torch.float32 else tol  # clip fractions: float32
        torch.testing.assert_close(stats[name], value.to(stats[name].dtype), **stat_tol, msg=lambda m: f"{name}: {m}")
    for name, g, w in zip(("hidden", "weight", "bias"), grads, want_grads):
        scale = max(float(w.abs().max()), 1.0)
        w = w.to(g.dtype)
        torch.testing.assert_close(
            g, w, rtol=tol["rtol"], atol=tol["atol"] * scale, msg=lambda m: f"{what} {name}: {m}"
        )


@pytest.mark.parametrize("mode, backend, agg, dtype", tiers.sampled(list(packed_cases()), strength=1))
def test_packed_tokens_equal_the_padded_call_and_float64(monkeypatch, mode, backend, agg, dtype):
    """Packed input (cu_seqlens) on every backend: the padded call's loss, stats and gradients at the valid
    tokens (the chunks, 14 tokens, cut through sequences), and the float64 reference's, and no padded
    ``[S, longest]`` layout built on the way (``_varlen.Layout``, made to fail)."""
    from ppo_fast import _varlen
    from ppo_fast.backends import _one_pass

    monkeypatch.setattr(_one_pass, "CHUNK_ELEMENTS", 2 * 7 * 53)  # the native rows' loop: chunks of 14 too
    x = make_inputs(zlib.crc32(f"packed-{mode}-{agg}".encode()), dtype=dtype, dims=(7, 7, 53, 13), weighted=True)
    valid = torch.arange(7)[None, :] < torch.tensor(PACKED_LENGTHS)[:, None]
    x["mask"] = x["mask"] & valid
    if mode == "vanilla":  # no KL term: native's C++ one pass (the aggregation's factors as its token weights)
        x["ref"] = None

    def result(x, run):
        loss, stats = run(x)
        return loss.detach(), stats, torch.autograd.grad(loss * 1.7, leaves(x))

    want = result(x, lambda x: packed_call(x, None, mode, agg, backend))
    with monkeypatch.context() as patch:
        patch.setattr(_varlen.Layout, "of", lambda *a, **k: pytest.fail("the packed call built the padded layout"))
        got = result(x, lambda x: packed_call(x, valid, mode, agg, backend))
    assert_result_close(got, want, TOLERANCE[dtype], "packed vs padded")
    wide = {
        k: v if v is None or not v.is_floating_point() else v.detach().double().requires_grad_() for k, v in x.items()
    }
    oracle = result(wide, lambda x: packed_call(x, valid, mode, agg, "reference"))
    assert_result_close(got, oracle, TOLERANCE[dtype], "packed vs float64")


# A sequence-level mode's packed one pass: chunks of whole sequences (14 tokens), two of them longer than one.
LONG_LENGTHS = [20, 0, 1, 5, 17, 2, 3, 9]


def test_segment_chunks_cut_at_sequence_ends():
    """The planner: whole sequences as many as fit, a longer one a chunk of its own, empty ones anywhere."""
    from ppo_fast.backends._one_pass import segment_chunks

    assert segment_chunks([0, 3, 3, 10, 11, 30, 35], 8) == [(0, 3), (3, 11), (11, 30), (30, 35)]
    assert segment_chunks([0, 9, 9, 12], 8) == [(0, 9), (9, 12)]
    assert segment_chunks([0, 2, 4, 6], 8) == [(0, 6)]
    assert segment_chunks([0], 8) == segment_chunks([0, 0, 0], 8) == [(0, 0)]


def sequence_level_cases():
    """GSPO and GMPO x backend x every agg; the fast tier: native's every agg (C++ GSPO, GMPO on the rows'
    loop with the reference's chunk terms), the reference's a seq-mean agg each, the interpreted Triton's
    (~15 s) GMPO's seq-mean-token-sum-norm (its T the longest sequence's), where the packed float16 test
    above runs GSPO's."""
    modes = [name for name in FUSED if POLICY_LOSS_MODES[name].sequence_level]
    fast_aggs = {"reference": {"seq-mean-token-sum-norm"}, "triton": {"seq-mean-token-sum-norm"}}
    for mode in modes:
        for case in cases([mode]):
            backend = case.values[1]
            for agg in AGG_MODES:
                fast = agg in fast_aggs.get(backend, AGG_MODES) and (backend != "triton" or mode == "geo_mean")
                yield tiers.case(*case.values, agg, fast=fast, id=f"{case.id}-{agg}")


@pytest.mark.parametrize("mode, backend, agg", list(sequence_level_cases()))
def test_packed_sequence_level_modes_take_one_pass(monkeypatch, mode, backend, agg):
    """GSPO and GMPO on packed tokens with ``cu_seqlens`` on the host take the one pass (chunks cut at
    sequence ends, two sequences longer than a chunk, masks inside them, an empty and a single-token one,
    weights, a KL term and the entropy bonus), never ``linear_token_logprobs``: the padded call's loss,
    stats and gradients, and the two-pass path's (what the call takes with the bounds on the device), in
    float64; Triton's in float32 (its plan's chunks of 14 tokens too), its per-token terms the fused
    kernel's (``_policy_terms.Batch`` on the packed sequences; the reference's terms made to fail), and
    the float64 reference's."""
    from ppo_fast import _varlen
    from ppo_fast.backends import _one_pass

    op_module = importlib.import_module("ppo_fast.ops.linear_policy_loss")
    monkeypatch.setattr(_one_pass, "CHUNK_ELEMENTS", 2 * 7 * 53)  # the native rows' loop: chunks of 14 too
    dtype = torch.float32 if backend == "triton" else torch.float64
    if backend == "triton":
        plan = importlib.import_module("ppo_fast.backends._head_plan")
        for name, value in (("MIN_ROWS", 14), ("MAX_ROWS", 14), ("ROW_STEP", 7)):
            monkeypatch.setattr(plan, name, value)
    x = make_inputs(zlib.crc32(f"seq-{mode}-{agg}".encode()), dtype=dtype, dims=(8, 20, 53, 13), weighted=True)
    valid = torch.arange(20)[None, :] < torch.tensor(LONG_LENGTHS)[:, None]
    x["mask"] = x["mask"] & valid

    def result(run, x=x):
        loss, stats = run()
        return loss.detach(), stats, torch.autograd.grad(loss * 1.7, leaves(x))

    padded = result(lambda: packed_call(x, None, mode, agg, backend))
    with monkeypatch.context() as patch:
        patch.setattr(_varlen.Layout, "of", lambda *a, **k: pytest.fail("the packed call built the padded layout"))
        patch.setattr(op_module, "linear_token_logprobs", lambda *a, **k: pytest.fail("two passes"))
        if backend == "triton":
            triton_loss = importlib.import_module("ppo_fast.backends.triton.linear_policy_loss")
            patch.setattr(triton_loss, "_per_token_grads", lambda *a, **k: pytest.fail("not the fused terms"))
        got = result(lambda: packed_call(x, valid, mode, agg, backend))
    assert_result_close(got, padded, TOLERANCE[dtype], "one pass vs padded")
    monkeypatch.setattr(op_module, "_host_bounds", lambda segments: False)
    two_passes = result(lambda: packed_call(x, valid, mode, agg, backend))
    assert_result_close(got, two_passes, TOLERANCE[dtype], "one pass vs two passes")
    if dtype != torch.float64:
        wide = {
            k: v if v is None or not v.is_floating_point() else v.detach().double().requires_grad_()
            for k, v in x.items()
        }
        oracle = result(lambda: packed_call(wide, valid, mode, agg, "reference"), wide)
        assert_result_close(got, oracle, TOLERANCE[dtype], "one pass vs float64")


def test_host_bounds_need_a_host_cu_seqlens_in_eager_mode(monkeypatch):
    """The sequence-level one pass plans its chunks from ``Segments.host``: present for a ``cu_seqlens``
    given on the host beside tokens on another device (meta stands in for CUDA here), whose values are
    then checked on the host; absent for one given on the device; never under torch.compile."""
    from ppo_fast._varlen import Segments

    op_module = importlib.import_module("ppo_fast.ops.linear_policy_loss")
    device, host = torch.device("meta"), torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    segments = Segments.of(host, 12, device)
    assert segments.host.device.type == "cpu" and segments.host.dtype == torch.int64
    assert segments.host.tolist() == [0, 5, 5, 12] and segments.max_seqlen == 7
    assert segments.cu_seqlens.device == device and segments.ids.device == device
    assert op_module._host_bounds(segments)
    for bad, words in (([1, 5, 12], "start at 0"), ([0, 8, 3, 12], "be non-decreasing"), ([0, 5, 11], "end at")):
        with pytest.raises(ValueError, match=f"cu_seqlens must {words}"):
            Segments.of(torch.tensor(bad), 12, device)
    with pytest.raises(ValueError, match="max_seqlen must be the longest sequence's length 7, got 6"):
        Segments.of(host, 12, device, max_seqlen=6)
    with pytest.raises(ValueError, match="cu_seqlens must be on the tokens' device cpu or on the host, got meta"):
        Segments.of(host.to(device), 12, torch.device("cpu"))
    on_device = Segments.of(host.to(device), 12, device)
    assert on_device.host is None and not op_module._host_bounds(on_device)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not op_module._host_bounds(segments)


def _packed_on(device, x, valid, dtype):
    """``x``'s valid tokens packed ``[N, ...]`` on ``device`` in ``dtype`` (hidden, weight and bias leaves),
    and their ``cu_seqlens`` on the host."""

    def moved(name, value):
        if value is None:
            return None
        value = value.detach() if name in ("weight", "bias") else value.detach()[valid]
        value = value.to(device, dtype=dtype if value.is_floating_point() else value.dtype)
        return value.requires_grad_(name in ("hidden", "weight", "bias"))

    lengths = valid.sum(-1)
    return {k: moved(k, v) for k, v in x.items()}, torch.nn.functional.pad(lengths.cumsum(0), (1, 0))


def _device_result(p, cu_seqlens, mode, agg, backend):
    args = [p[name] for name in ("hidden", "weight", "labels", "old", "adv", "mask")]
    terms = dict(weights=p["weights"], bias=p["bias"], ref_logprobs=p["ref"], kl_coef=0.1, entropy_coef=0.01)
    with pf.use_backend(backend):
        loss, stats = pf.linear_policy_loss(
            *args, loss_mode=mode, agg=agg, **terms, **mode_params(mode), cu_seqlens=cu_seqlens
        )
        return loss.detach(), stats, torch.autograd.grad(loss * 1.7, leaves(p))


def _on_cpu(result):
    loss, stats, grads = result
    return loss.cpu(), {k: v.cpu() for k, v in stats.items()}, [g.cpu() for g in grads]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode, agg", [("gspo", "seq-mean-token-sum-norm"), ("geo_mean", "token-mean")])
def test_packed_sequence_level_one_pass_on_cuda_with_a_host_cu_seqlens(monkeypatch, mode, agg, dtype):
    """CUDA tokens, ``cu_seqlens`` on the host: GSPO and GMPO take the one pass (``linear_token_logprobs``,
    the two passes' first, made to fail), forward and backward with no host sync (under
    ``set_sync_debug_mode("error")``, after a warm-up), on every backend that serves CUDA; loss, stats and the
    gradients of hidden, weight and bias equal the two passes' (``_host_bounds`` False) and the float64
    reference's on CPU.  The same call with ``cu_seqlens`` on CUDA takes the two passes, with the same result."""
    from ppo_fast.backends import _one_pass

    op_module = importlib.import_module("ppo_fast.ops.linear_policy_loss")
    monkeypatch.setattr(_one_pass, "CHUNK_ELEMENTS", 2 * 7 * 53)  # chunks of 14 tokens: two sequences longer
    x = make_inputs(zlib.crc32(f"cuda-{mode}-{agg}".encode()), dtype=dtype, dims=(8, 20, 53, 13), weighted=True)
    valid = torch.arange(20)[None, :] < torch.tensor(LONG_LENGTHS)[:, None]
    x["mask"] = x["mask"] & valid
    wide = {
        k: v if v is None or not v.is_floating_point() else v.detach().double().requires_grad_() for k, v in x.items()
    }
    loss, stats = packed_call(wide, None, mode, agg, "reference")  # the padded call defines the packed one's
    d_hidden, *d_head = torch.autograd.grad(loss * 1.7, leaves(wide))
    oracle = loss.detach(), stats, [d_hidden[valid], *d_head]
    p, host = _packed_on("cuda", x, valid, dtype)
    tol = TOLERANCE[dtype]
    for backend in serving(POLICY_LOSS_MODES[mode].linear_op, "cuda"):
        with monkeypatch.context() as patch:
            patch.setattr(op_module, "linear_token_logprobs", lambda *a, **k: pytest.fail(f"{backend}: two passes"))
            _device_result(p, host, mode, agg, backend)  # warm-up: Triton compiles, the caches fill
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                one_pass = _device_result(p, host, mode, agg, backend)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert_result_close(_on_cpu(one_pass), oracle, tol, f"{backend} one pass vs float64")
        with monkeypatch.context() as patch:
            patch.setattr(op_module, "_host_bounds", lambda segments: False)
            two_passes = _device_result(p, host, mode, agg, backend)
        assert_result_close(one_pass, two_passes, tol, f"{backend} one pass vs two passes")
        first_passes = []
        real = op_module.linear_token_logprobs
        with monkeypatch.context() as patch:
            patch.setattr(op_module, "linear_token_logprobs", lambda *a, **k: first_passes.append(1) or real(*a, **k))
            on_device = _device_result(p, host.cuda(), mode, agg, backend)
        assert first_passes == [1], f"{backend}: a CUDA cu_seqlens took the one pass"
        assert_result_close(on_device, two_passes, tol, f"{backend} a CUDA cu_seqlens vs two passes")


# Padded sequences longer than the plan's step (``_head_plan.token_slices``): the packed layout's token slices.
# The step forced to 7 (``short_step``), so that the sequences just above it are short to run.
STEP = 7


@pytest.fixture
def short_step(monkeypatch):
    plan = importlib.import_module("ppo_fast.backends._head_plan")
    assert plan.ROW_STEP == 128 and not plan.token_slices(128) and plan.token_slices(129)  # the unforced step
    monkeypatch.setattr(plan, "ROW_STEP", STEP)
    return plan


def long_padded_inputs(seed, dtype, ref=True):
    """4 sequences of ``STEP + 3`` tokens (V=40, H=16): masked tokens, an empty response, ignored labels, and
    every row's last 2 tokens masked (the longest response shorter than ``T``, whose norm is ``T``)."""
    x = make_inputs(seed, dtype=dtype, dims=(4, STEP + 3, 40, 16), weighted=True)
    x["mask"][:, -2:] = False
    if not ref:
        x["ref"] = None
    return x


def long_padded_cases():
    """Every aggregation x backend x float64/float32 x a KL term or not (native without one: its C++ one pass,
    the factors as token weights; with one: the rows' loop); the fast tier covers each pair of them."""
    params = []
    for case in cases(["vanilla"]):
        for agg in AGG_MODES:
            for dtype in (torch.float64, torch.float32):
                for kl in (True, False):
                    name = f"{case.id}-{agg}-{str(dtype)[6:]}-{'kl' if kl else 'no-kl'}"
                    params.append(pytest.param(*case.values[1:], agg, dtype, kl, id=name))
    return tiers.sampled(params, strength=2)


@pytest.mark.parametrize("backend, agg, dtype, kl", long_padded_cases())
def test_long_padded_sequences_take_token_slices_equal_to_the_two_pass_composition(
    monkeypatch, short_step, backend, agg, dtype, kl
):
    """A padded call of sequences longer than ``ROW_STEP`` is run as the packed layout of its tokens (once a
    call), and its loss, stats and gradients w.r.t. the ``[B, T, H]`` hidden, weight and bias equal the
    two-pass composition's (the chunks, 14 or 18 tokens, cut through the sequences)."""
    op_module = importlib.import_module("ppo_fast.ops.linear_policy_loss")
    from ppo_fast.backends import _one_pass

    monkeypatch.setattr(_one_pass, "CHUNK_ELEMENTS", 2 * 7 * 53)  # the native rows' loop: chunks of 18 tokens
    converted, as_packed = [], op_module._padded_as_packed

    def spy(hidden, labels, x):
        converted.append(tuple(hidden.shape))
        return as_packed(hidden, labels, x)

    monkeypatch.setattr(op_module, "_padded_as_packed", spy)
    x = long_padded_inputs(zlib.crc32(f"long-{backend}-{agg}".encode()), dtype, ref=kl)
    loss, stats = packed_call(x, None, "vanilla", agg, backend)
    got = loss.detach(), stats, torch.autograd.grad(loss * 1.7, leaves(x))
    assert converted == [(4, STEP + 3, 16)]
    want_loss, want_stats = two_pass(x, "vanilla", agg)
    want = want_loss.detach(), want_stats, torch.autograd.grad(want_loss * 1.7, leaves(x))
    assert_result_close(got, want, TOLERANCE[dtype], "long padded vs two passes")


@pytest.mark.parametrize("mode", ["gspo", "clip_cov"])
def test_long_padded_sequences_of_sequence_level_and_two_pass_modes_stay_padded(monkeypatch, short_step, mode):
    """A sequence-level mode (whole sequences a chunk, the mode's terms on them) and a batch-wide one (the two
    passes) are not converted: the reference's call, equal to the two-pass composition."""
    op_module = importlib.import_module("ppo_fast.ops.linear_policy_loss")
    monkeypatch.setattr(op_module, "_padded_as_packed", lambda *a: pytest.fail("converted to the packed layout"))
    x = long_padded_inputs(41, torch.float64)
    check_against_two_pass(x, mode, "seq-mean-token-mean", "reference", torch.float64)


def test_an_empty_batch_of_long_sequences_stays_padded(monkeypatch, short_step):
    """No sequence (B = 0) of T past the step: nothing to chunk, the padded call's empty result (a segment
    layout of no sequence could not carry ``T``)."""
    op_module = importlib.import_module("ppo_fast.ops.linear_policy_loss")
    monkeypatch.setattr(op_module, "_padded_as_packed", lambda *a: pytest.fail("converted to the packed layout"))
    one = make_inputs(43, dtype=torch.float64, dims=(1, STEP + 3, 40, 16))
    x = {k: v if k in ("weight", "bias") or v is None else v.detach()[:0] for k, v in one.items()}
    x["hidden"].requires_grad_()
    check_against_two_pass(x, "vanilla", "seq-mean-token-sum-norm", "reference", torch.float64)


@pytest.mark.parametrize("backend", [c.values[1] for c in cases(["vanilla"])])
def test_long_padded_sequences_norm_by_their_own_length(short_step, backend):
    """seq-mean-token-sum-norm of the converted call divides by the padded call's ``T`` (the packed layout's
    ``max_seqlen``), not by its longest response (``T - 2``): the two-pass composition's loss, and not that
    loss rescaled to the longest response."""
    x = long_padded_inputs(7, torch.float64, ref=False)
    loss, _ = packed_call(x, None, "vanilla", "seq-mean-token-sum-norm", backend)
    want, _ = two_pass(x, "vanilla", "seq-mean-token-sum-norm")
    torch.testing.assert_close(loss, want, **TOLERANCE[torch.float64])
    longest = int(x["mask"].sum(-1).max())
    assert longest < STEP + 3
    assert not torch.allclose(loss, want * (STEP + 3) / longest, rtol=1e-3)


@pytest.mark.parametrize("length", [STEP, STEP + 2], ids=["short", "long"])
def test_the_triton_loss_chunks_padded_long_sequences_as_its_plan(monkeypatch, short_step, length):
    """A paired 4-row plan (bf16, 100% budget) on 3 padded sequences: of ``ROW_STEP`` (7) tokens, whole
    sequences (three d_weight products of 7 rows: their pairs do not fit); of 9, token slices of the plan's
    4 rows (27 tokens: 7 chunks, the last padded, three pairs of 8 rows and one of 4), the loss, stats and
    gradients within bf16's tolerance of the float64 two-pass composition's."""
    if "triton" not in serving("linear_policy_loss_vanilla", "cpu"):
        pytest.skip("the Triton backend does not serve the one pass here")
    plan, gemm_head = short_step, importlib.import_module("ppo_fast.backends.triton._gemm_head")
    monkeypatch.setattr(plan, "MEMORY_BUDGET", 1.0)
    monkeypatch.setattr(gemm_head, "head_plan", lambda *a, **k: plan.HeadPlan(4, 2, True))
    x = make_inputs(37, dtype=torch.bfloat16, dims=(3, length, 40, 16), weighted=True)
    products, chunk_rows, addmm, chunk_logits = [], set(), gemm_head._addmm_, gemm_head.chunk_logits

    def spy_addmm(out, a, b):
        if out.shape == x["weight"].shape:  # d_weight's products: their rows
            products.append(a.shape[1])
        addmm(out, a, b)

    def spy_chunk(*args, rows, **kwargs):
        chunk_rows.add(rows)
        return chunk_logits(*args, rows=rows, **kwargs)

    monkeypatch.setattr(gemm_head, "_addmm_", spy_addmm)
    monkeypatch.setattr(gemm_head, "chunk_logits", spy_chunk)
    loss, stats = packed_call(x, None, "vanilla", "seq-mean-token-mean", "triton")
    got = loss.detach(), stats, torch.autograd.grad(loss * 1.7, leaves(x))
    if length == STEP:
        assert chunk_rows == {STEP} and products == [STEP] * 3
    else:
        assert chunk_rows == {4} and products == [8, 8, 8, 4]
    wide = {
        k: v if v is None or not v.is_floating_point() else v.detach().double().requires_grad_() for k, v in x.items()
    }
    loss, stats = two_pass(wide, "vanilla", "seq-mean-token-mean")
    oracle = loss.detach(), stats, torch.autograd.grad(loss * 1.7, leaves(wide))
    assert_result_close(got, oracle, TOLERANCE[torch.bfloat16], "triton bf16 vs float64")
