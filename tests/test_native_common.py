"""Helpers shared by the native backend's tests (tests/backends/test_native_*.py) and by
tests that import ``requires_native``: the skip when the extension is missing, input makers.
No tests of its own (the registration tests are in tests/backends/test_native_cpu_ops.py)."""

import pytest
import torch

from ppo_fast.backends import backend_info

NATIVE = backend_info("native")
requires_native = pytest.mark.skipif(not NATIVE.available, reason=f"native backend unavailable: {NATIVE.detail}")


def random_mask(shape, device="cpu"):
    """A random mask with interior holes, one all-masked row and (if there are 3+ rows) one full row."""
    mask = torch.rand(shape, device=device) < 0.7
    mask[0] = False
    if shape[0] > 2:
        mask[2] = True
    return mask


def random_holes_mask(shape, device="cpu"):
    """random_mask plus, in every row with 3+ valid tokens, one interior hole and a
    masked last position (so the last valid token is not the last position)."""
    mask = random_mask(shape, device)
    if shape[1] >= 4:
        mask[1:, shape[1] // 2] = False
        mask[1:, -1] = False
    return mask


def policy_inputs(shape, dtype, device="cpu"):
    """log-probs, old log-probs and advantages of ``dtype``; some log-ratios beyond the +-20 clamp."""
    logprobs = -torch.rand(shape, device=device) * 3
    old = logprobs + 0.4 * torch.randn(shape, device=device)
    far = torch.rand(shape, device=device) < 0.05
    old = torch.where(far, logprobs + 25.0 * torch.sign(torch.randn(shape, device=device)), old)
    advantages = torch.randn(shape, device=device)
    return logprobs.to(dtype), old.to(dtype), advantages.to(dtype)
