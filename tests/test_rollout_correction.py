"""Rollout-correction weights (TIS / MIS) against a plain formula and verl 0.9.1's own
``compute_rollout_correction_weights`` (skipped where verl is not installed)."""

import math

import pytest
import torch

import ppo_fast as pf
from ppo_fast.spec import ROLLOUT_CORRECTION_MODES


def _inputs(seed, b=5, t=9, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(b, t, generator=gen, dtype=dtype) * 0.4 - 1.0
    rollout = old + torch.randn(b, t, generator=gen, dtype=dtype) * 0.5
    mask = torch.rand(b, t, generator=gen) < 0.7
    mask[0] = False  # a row without tokens
    mask[-1] = True
    return old, rollout, mask


def _formula(old, rollout, mask, mode, *, threshold, threshold_low, batch_normalize):
    """Written from the definitions, row by row and token by token."""
    out = torch.zeros_like(old)
    for i in range(old.shape[0]):
        valid = [j for j in range(old.shape[1]) if mask[i, j]]
        seq = math.exp(max(-20.0, min(20.0, sum(float(old[i, j] - rollout[i, j]) for j in valid))))
        for j in valid:
            w = seq if mode.startswith("seq") else math.exp(max(-20.0, min(20.0, float(old[i, j] - rollout[i, j]))))
            if mode.endswith("tis"):
                w = min(w, threshold)
            elif not threshold_low <= w <= threshold:
                w = 0.0
            out[i, j] = w
    if batch_normalize:
        if mode.startswith("seq"):
            rows = [out[i][mask[i]][0] for i in range(old.shape[0]) if mask[i].any()]
            mean = sum(rows) / len(rows)
        else:
            mean = out[mask].mean()
        if mean > 1e-8:
            out = out / mean
    return out


@pytest.mark.parametrize("mode", ROLLOUT_CORRECTION_MODES)
@pytest.mark.parametrize("batch_normalize", [False, True])
def test_matches_the_formula(mode, batch_normalize):
    old, rollout, mask = _inputs(11)
    kwargs = dict(threshold=1.1, threshold_low=0.5 if mode.endswith("mis") else 0.0, batch_normalize=batch_normalize)
    got = pf.rollout_correction_weights(old, rollout, mask, mode=mode, **kwargs)
    want = _formula(old, rollout, mask, mode, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert got.dtype == torch.float64 and not got.requires_grad
    assert ((got > 0) <= mask).all()  # masked positions are 0
    if mode.endswith("tis") and not batch_normalize:
        assert (got == 1.1).any()  # something was truncated, so the test can fail


def test_masked_values_reach_nothing_and_float32_results():
    old, rollout, mask = _inputs(3, dtype=torch.float32)
    clean = pf.rollout_correction_weights(old, rollout, mask, mode="seq_tis")
    poisoned = torch.where(mask, old, torch.tensor(math.nan))
    got = pf.rollout_correction_weights(poisoned, rollout.bfloat16(), mask.float(), mode="seq_tis")
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    torch.testing.assert_close(got, pf.rollout_correction_weights(old, rollout.bfloat16(), mask, mode="seq_tis"))
    assert clean.shape == old.shape


@pytest.mark.parametrize("mode", ROLLOUT_CORRECTION_MODES)
@pytest.mark.parametrize("batch_normalize", [False, True])
def test_matches_verl(mode, batch_normalize):
    corr = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper", reason="verl is not installed")
    old, rollout, mask = _inputs(23)
    masked_mode = mode.endswith("mis")
    want, _ = corr.compute_rollout_correction_weights(
        old - rollout,
        mask.double(),
        rollout_is="token" if mode.startswith("token") else "sequence",
        rollout_is_threshold="0.6_1.4" if masked_mode else 1.4,
        rollout_is_batch_normalize=batch_normalize,
    )
    low = 0.6 if masked_mode else 0.0
    got = pf.rollout_correction_weights(
        old, rollout, mask, mode=mode, threshold=1.4, threshold_low=low, batch_normalize=batch_normalize
    )
    # verl's batch mean divides by (count + 1e-8): a relative difference of about 1e-9.
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-8, atol=1e-12)
