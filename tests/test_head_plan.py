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
@pytest.mark.parametrize("h, v", [(896, 151936), (4096, 128256)])
def test_every_phase_is_linear_in_the_rows(kind, h, v):
    """At N = m chunks, every phase's FLOPs, bytes and launches are a + b m exactly (no N^2 term, as the
    tile backward's fixed scratch had); between chunk multiples, at most one chunk's fixed cost more."""

    def at(n):
        return {p.name: p for p in plan.phases(kind, n, h, v)}

    c = plan.CHUNK_ROWS
    one, two = at(c), at(2 * c)
    for m in (3, 8, 32):
        got = at(m * c)
        assert got.keys() == one.keys()
        for name, p in got.items():
            for field in ("flops", "bytes", "launches"):
                a, b = getattr(one[name], field), getattr(two[name], field)
                assert getattr(p, field) == pytest.approx(a + (m - 1) * (b - a), rel=1e-12), (name, field, m)
    odd = at(5 * c + 7)
    for name, p in odd.items():
        assert p.bytes <= at(6 * c)[name].bytes and p.launches <= at(6 * c)[name].launches + 1  # zero the padding


def test_flop_counts_are_the_designs():
    """6 N H V for the one-pass loss (the linear layer's), 8 N H V for log-probs with a recomputing backward
    (N a multiple of the chunk; otherwise the last chunk's padding rows count too)."""
    n, h, v = 3 * plan.CHUNK_ROWS, 64, 1000
    flops = {k: sum(p.flops for p in plan.phases(k, n, h, v)) for k in KINDS}
    assert flops["loss_fwd"] + flops["loss_bwd"] == 6 * n * h * v == flops["linear_fwd"] + flops["linear_bwd"]
    assert flops["logprobs_fwd"] + flops["logprobs_bwd"] == 8 * n * h * v
    padded = sum(p.flops for p in plan.phases("logprobs_fwd", n - 5, h, v))
    assert padded == 2 * n * h * v  # the last chunk's product has the chunk's rows
