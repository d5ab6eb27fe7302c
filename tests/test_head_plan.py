"""The GEMM-first head's planner (ppo_fast/backends/_head_plan.py): chunks by rows, and no phase whose
bytes or launches grow faster than the rows N; the roofline model (bench/head_model.py) reads it."""

from __future__ import annotations

import pytest

from ppo_fast.backends import _head_plan as plan

KINDS = ("logprobs_fwd", "logprobs_bwd", "loss_fwd", "loss_bwd", "linear_fwd", "linear_bwd")


def test_row_chunks_cover_the_rows_once():
    assert plan.row_chunks(0) == []
    assert plan.row_chunks(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert plan.sequence_chunks(5, 3, 7) == [(0, 2), (2, 4), (4, 5)]  # two sequences of 3 rows fit 7
    assert plan.sequence_chunks(2, 9, 4) == [(0, 1), (1, 2)]  # a sequence longer than a chunk: one a chunk
    with pytest.raises(ValueError, match="rows must be >= 1"):
        plan.row_chunks(3, 0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("h, v, chunk", [(896, 151936, plan.HeadPlan(2048, 4)), (4096, 128256, plan.HeadPlan(384, 2))])
def test_every_phase_is_linear_in_the_rows(kind, h, v, chunk):
    """At N = m chunks, every phase's FLOPs, bytes and launches are a + b m exactly (no N^2 term, as the
    tile backward's fixed scratch had); between chunk multiples, at most one chunk's fixed cost more."""

    def at(n):
        return {p.name: p for p in plan.phases(kind, n, h, v, rows=chunk.rows, acc=chunk.acc)}

    c = chunk.rows
    one, two = at(c), at(2 * c)
    _assert_linear(at, c, one, two)
    odd = at(5 * c + 7)
    for name, p in odd.items():
        assert p.bytes <= at(6 * c)[name].bytes and p.launches <= at(6 * c)[name].launches + 1  # zero the padding


@pytest.mark.parametrize("h, v", [(4096, 151936), (896, 128256)])
def test_every_phase_of_the_paired_loss_is_linear_in_the_rows(h, v):
    """The paired loss (``HeadPlan.pair``): at N = m pairs every phase is a + b m exactly; an odd chunk
    count's last chunk alone costs at most one chunk's products more than the pairs around it."""
    rows = 256

    def at(n):
        return {p.name: p for p in plan.phases("loss_fwd", n, h, v, rows=rows, acc=2, pair=True)}

    pair = 2 * rows
    _assert_linear(at, pair, at(pair), at(2 * pair))
    odd, even = at(5 * rows), at(6 * rows)
    for name, p in odd.items():
        assert p.bytes <= even[name].bytes and p.launches <= even[name].launches, name
    d_weight = "d_weight += d_logits.T @ hidden (accumulator)"
    assert odd[d_weight].launches == 3 and odd[d_weight].flops == 2 * 5 * rows * h * v  # two pairs, one alone
    flops = sum(p.flops for p in plan.phases("loss_fwd", 6 * rows, h, v, rows=rows, acc=2, pair=True))
    assert flops + sum(p.flops for p in plan.phases("loss_bwd", 6 * rows, h, v)) == 6 * 6 * rows * h * v


def test_flop_counts_are_the_designs():
    """6 N H V for the one-pass loss (the linear layer's), 8 N H V for log-probs with a recomputing backward
    (N a multiple of the chunk; otherwise the last chunk's padding rows count too)."""
    n, h, v = 3 * plan.CHUNK_ROWS, 64, 1000
    flops = {k: sum(p.flops for p in plan.phases(k, n, h, v)) for k in KINDS}
    assert flops["loss_fwd"] + flops["loss_bwd"] == 6 * n * h * v == flops["linear_fwd"] + flops["linear_bwd"]
    assert flops["logprobs_fwd"] + flops["logprobs_bwd"] == 8 * n * h * v
    padded = sum(p.flops for p in plan.phases("logprobs_fwd", n - 5, h, v))
    assert padded == 2 * n * h * v  # the last chunk's product has the chunk's rows


ISSUE = (16384, 4096, 151936)  # issue 49's shape, bf16: its logits are 4.98 GB, 5% of them 249 MB


def test_the_default_budget_meets_five_percent_at_the_issues_shape():
    """384 rows a chunk unpaired (the largest multiple of 128 whose float32 logits, 233 MB, fit beside the
    chunk's hidden and d_hidden rows in 249 MB; 512 rows would take 311 MB) and d_weight in the bf16
    gradient (a float32 accumulator alone is V H 2 = 1.25 GB beyond it); the loss pairs 256-row chunks
    (their float32 logits and the pair's first bf16 d_logits, 233 MB; 384 paired: 350 MB), so that its
    d_weight product has 512 rows, over the H100's ridge (460 rows for a bf16 accumulator)."""
    n, h, v = ISSUE
    limit = 0.05 * n * v * 2
    assert plan.plan("logprobs", n, h, v) == plan.HeadPlan(384, 2)
    assert plan.plan("loss", n, h, v, paired=False) == plan.HeadPlan(384, 2)
    assert plan.plan("loss", n, h, v) == plan.HeadPlan(256, 2, True)
    for phase in ("loss_fwd", "logprobs_bwd"):
        assert plan.extra_memory(phase, n, h, v, rows=384, acc=2) <= limit
        assert plan.extra_memory(phase, n, h, v, rows=512, acc=2) > limit
    assert plan.extra_memory("loss_fwd", n, h, v, rows=256, acc=2, pair=True) <= limit
    assert plan.extra_memory("loss_fwd", n, h, v, rows=384, acc=2, pair=True) > limit
    assert plan.pair_fits(n, h, v, 256) and not plan.pair_fits(n, h, v, 384)


def test_the_loss_pairs_only_a_narrow_accumulator_below_the_ridge_where_the_pairs_fit_and_win():
    """float16 (no narrow accumulator), float32 and float64 never pair; a budget whose pairs do not fit
    (or whose unpaired chunks reach the ridge) gives the unpaired plan; at H = 896 the pairs fit but the
    roofline predicts them slower (memory-bound products and row kernels at either size): unpaired."""
    n, h, v = ISSUE
    assert plan.plan("loss", n, h, v, narrow=False) == plan.HeadPlan(384, 4)
    assert not plan.plan("loss", n, h, v, itemsize=4).pair and not plan.plan("loss", n, h, v, itemsize=8).pair
    # 239 MB: neither 384 rows unpaired (243 MB) nor 256 paired (245 MB) fits: the smallest plan, unpaired
    assert plan.plan("loss", n, h, v, budget=0.048) == plan.HeadPlan(plan.MIN_ROWS, 2)
    assert plan.plan("loss", n, h, v, budget=0.08) == plan.HeadPlan(512, 2)  # over the ridge's 460 rows
    assert plan.plan("loss", n, 896, v) == plan.HeadPlan(384, 2)
    assert plan.pair_fits(n, 896, v, 256)
    assert plan.plan("logprobs", n, h, v) == plan.HeadPlan(384, 2)  # log-probs never pair


def test_the_loss_plan_follows_its_budget():
    """A larger budget buys larger d_weight products (a chunk's rows, twice them paired), then the float32
    accumulator (from 1024 rows); every plan found fits its budget; a budget no plan fits gets the
    smallest."""
    n, h, v = ISSUE
    logits = n * v * 2
    assert plan.plan("loss", n, h, v, budget=1.0) == plan.HeadPlan(2048, 4)
    # 1.49 GB: a float32 accumulator (1.25 GB) leaves 393 rows; bf16 the largest chunk (2048 rows, 1.30 GB)
    assert plan.plan("loss", n, h, v, budget=0.3) == plan.HeadPlan(2048, 2)
    previous = (0, 0)
    for budget in (0.0, 0.01, 0.05, 0.07, 0.1, 0.2, 0.3, 0.4, 0.6, 1.0):
        chosen = plan.plan("loss", n, h, v, budget=budget)
        assert (chosen.acc, chosen.rows * (1 + chosen.pair)) >= previous, budget
        held = plan.extra_memory("loss_fwd", n, h, v, **chosen._asdict())
        assert held <= budget * logits or chosen == plan.HeadPlan(plan.MIN_ROWS, 2), budget
        previous = (chosen.acc, chosen.rows * (1 + chosen.pair))


def test_the_accumulator_by_dtype_and_the_logprobs_rows_by_nothing_but_the_plan():
    """float16 keeps float32 (narrow=False); float32 and float64 accumulate in their own dtype at no extra
    bytes; log-probs' rows never follow N or the budget (a row's results must not depend on its batch)."""
    n, h, v = ISSUE
    assert plan.plan("loss", n, h, v, narrow=False).acc == 4
    assert plan.plan("loss", n, h, v, itemsize=4) == plan.HeadPlan(768, 4)  # 5% of float32 logits: 498 MB
    assert plan.plan("loss", n, h, v, itemsize=8).acc == 8
    for rows in (1, 1000, 16384, 65536):
        for budget in (0.0, 0.05, 1.0):
            assert plan.plan("logprobs", rows, h, v, budget=budget).rows == plan.LOGPROBS_ROWS
    for bad in (-0.1, float("nan"), "5%"):
        with pytest.raises(ValueError, match="budget must be"):
            plan.plan("loss", n, h, v, budget=bad)
    with pytest.raises(ValueError, match="kind must be"):
        plan.plan("loss_fwd", n, h, v)


def test_the_roofline_model_times_the_plan_the_kernels_run():
    """bench head_model's ``gemm`` design is the budget's plan (the loss: 64 chunks of 256 rows in 32 pairs at
    the issue's shape, d_weight added into the bf16 gradient: no rounding phase), within 5%; the 2048-row
    float32 plan beside it is not.  The pairs are predicted faster than 384-row chunks on an H100 and meet
    the loss's 1.15x there."""
    from bench import head_model

    rows = head_model.model(*ISSUE)
    fwd = {p["name"]: p for p in rows["gemm loss_fwd"]["phases"]}
    assert fwd["logits = hidden @ weight.T (cuBLAS, fp32 out)"]["launches"] == 64  # 16384 / 256
    assert fwd["d_weight += d_logits.T @ hidden (accumulator)"]["launches"] == 32
    assert "d_weight to the inputs' dtype" not in fwd
    unpaired = head_model.phases("loss_fwd", *ISSUE, rows=384, acc=2)
    paired = [plan.Phase(**p) for p in rows["gemm loss_fwd"]["phases"]]
    assert head_model.predicted_s(paired, "H100") < head_model.predicted_s(unpaired, "H100")
    assert head_model.goals(rows, *ISSUE)["loss fwd+bwd / linear fwd+bwd (H100)"]["met"]
    new, old = head_model.goals(rows, *ISSUE), head_model.goals(rows, *ISSUE, "gemm-2048")
    for call in ("loss", "logprobs"):
        key = f"{call} extra memory / logits' bytes"
        assert new[key]["met"] and not old[key]["met"], call


@pytest.mark.parametrize("kind", ("logprobs_fwd", "logprobs_bwd"))
@pytest.mark.parametrize("h, v, block", [(896, 151936, (512, 76032, 2)), (4096, 128256, (1024, 42752, 4))])
def test_every_phase_of_the_2d_plan_is_linear_in_the_rows(kind, h, v, block):
    """The 2-D plan (blocks of rows x vocabulary slices): at N = m blocks every phase's FLOPs, bytes and
    launches are a + b m exactly; between block multiples at most one block's more."""
    rows, cols, acc = block

    def at(n):
        return {p.name: p for p in plan.block_phases(kind, n, h, v, rows=rows, cols=cols, acc=acc)}

    one, two = at(rows), at(2 * rows)
    _assert_linear(at, rows, one, two)
    for name, p in at(5 * rows + 7).items():
        assert p.bytes <= at(6 * rows)[name].bytes and p.launches <= at(6 * rows)[name].launches + 3
    slices = -(-v // cols)
    flops = sum(p.flops for p in plan.block_phases(kind, 3 * rows, h, v, rows=rows, cols=cols, acc=acc))
    assert flops == (2 if kind == "logprobs_fwd" else 6) * 3 * rows * h * v  # the slices cover V once
    assert at(3 * rows)["logits[block, slice] = hidden @ weight[slice].T (cuBLAS, fp32 out)"].launches == 3 * slices


def test_the_2d_plan_at_the_issues_shape():
    """512 rows (the fewest multiple of 128 whose bf16 d_weight product, 2 x 512 FLOPs for 4 bytes a weight,
    is over an H100's 230 FLOPs a byte) by two slices of 76032 columns, within 5% at 16384 rows; the weight-
    sized traffic of the backward falls from 43 chunks' to 32 blocks'; the plan has no N to follow."""
    n, h, v = ISSUE
    chosen = plan.block_plan(h, v)
    assert chosen == plan.BlockPlan(512, 76032, 2)
    assert plan.block_extra_memory("logprobs_bwd", h, v, rows=512, cols=76032, acc=2) <= 0.05 * n * v * 2
    assert plan.block_extra_memory("logprobs_bwd", h, v, rows=512, cols=v, acc=2) > 0.05 * n * v * 2
    row = {p.name: p for p in plan.phases("logprobs_bwd", n, h, v, rows=384, acc=2)}
    blk = {p.name: p for p in plan.block_phases("logprobs_bwd", n, h, v, **chosen._asdict())}
    d_weight = blk["d_weight[slice] += d_logits.T @ hidden[block] (accumulator)"].bytes
    assert d_weight < 0.8 * row["d_weight += d_logits.T @ hidden (accumulator)"].bytes
    assert plan.block_plan(h, v, narrow=False).acc == 4 and plan.block_plan(h, v, budget=1.0).cols == v
    assert plan.block_plan(896, 128256).cols == 64128  # V / 2, already a multiple of 128: no wider
    with pytest.raises(ValueError, match="budget must be"):
        plan.block_plan(h, v, budget=-1.0)
    with pytest.raises(ValueError, match="kind must be"):
        plan.block_phases("loss_fwd", n, h, v, rows=512, cols=v)


def test_the_model_predicts_the_2d_plan_meets_the_h100_backward_goal():
    """bench head_model's gemm-2d design (predictions): log-probs fwd+bwd within 1.45x the linear layer on an
    H100 at the issue's shape, where the row plan is not, and no slower than the row plan on an H200."""
    from bench import head_model

    rows = head_model.model(*ISSUE)
    new, old = head_model.goals(rows, *ISSUE, "gemm-2d"), head_model.goals(rows, *ISSUE)
    key = "logprobs fwd+bwd / linear fwd+bwd"
    assert new[f"{key} (H100)"]["met"] and not old[f"{key} (H100)"]["met"]
    for d in ("H100", "H200"):
        for goal in (key, "logprobs fwd / linear fwd"):
            assert new[f"{goal} ({d})"]["ratio"] <= old[f"{goal} ({d})"]["ratio"], (goal, d)


def _assert_linear(at, c: int, one: dict, two: dict) -> None:
    """Every phase's FLOPs, bytes and launches at ``m * c`` rows are ``one + (m - 1) * (two - one)``
    (``one``, ``two``: the phases at ``c`` and ``2 c`` rows; ``at(n)``: the phases at ``n`` rows)."""
    for m in (3, 8, 32):
        got = at(m * c)
        assert got.keys() == one.keys()
        for name, p in got.items():
            for field in ("flops", "bytes", "launches"):
                a, b = getattr(one[name], field), getattr(two[name], field)
                assert getattr(p, field) == pytest.approx(a + (m - 1) * (b - a), rel=1e-12), (name, field, m)


def test_the_epilogue_forward_is_linear_in_the_rows_and_its_needed_efficiency_is_the_rooflines():
    """The "epilogue" forward (one grouped GEMM, the row work in its epilogue): every phase a + b m at m groups
    of row blocks, no logits' bytes (its partials 16 bytes a row a 256-column share: 3.1% of bf16 logits'),
    and bench head_model's efficiency it needs at the issue's shape, worked by hand: 1.10 x the linear
    layer's 20.39 TFLOP at 70% of 989.4 TFLOP/s, less the combine's read of the partials twice at 90% of
    3.35 TB/s, leaves the products 32.28 ms on an H100: 63.8% of the peak."""
    from bench import head_model

    n, h, v = ISSUE
    group = plan.EPILOGUE_ROWS * plan.EPILOGUE_GROUP

    def at(rows):
        return {p.name: p for p in plan.epilogue_phases("logprobs_fwd", rows, h, v)}

    _assert_linear(at, group, at(group), at(2 * group))
    assert plan.epilogue_extra_memory(n, v) == n * 594 * 16 and plan.epilogue_extra_memory(n, v) < 0.032 * n * v * 2
    assert plan.epilogue_phases("logprobs_bwd", n, h, v) == plan.block_phases(
        "logprobs_bwd", n, h, v, **plan.block_plan(h, v)._asdict()
    )
    linear_s = 2 * n * h * v / (989.4e12 * 0.7)
    combine_s = (2 * n * 594 * 16 + n * 16) / (3.35e12 * 0.9)
    by_hand = 2 * n * h * v / (989.4e12 * (1.10 * linear_s - combine_s))
    needed = head_model.needed_efficiency(head_model.model(n, h, v), n, h, v)
    assert needed["forward 1.10x (H100)"] == pytest.approx(by_hand, rel=1e-3) and 0.63 < by_hand < 0.645
    assert needed["fwd+bwd 1.45x (H100)"] < 0.7  # the 2-D backward leaves room at cuBLAS's speed
    with pytest.raises(ValueError, match="kind must be"):
        plan.epilogue_phases("loss_fwd", n, h, v)
