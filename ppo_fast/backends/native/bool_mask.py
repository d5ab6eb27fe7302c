"""Native bool_mask: the public ops' one-pass check and conversion of 0/1 float/int masks (CPU)."""

from __future__ import annotations

import torch

from ._common import register

SUPPORTED: dict = {}  # a helper of the public ops (ppo_fast._validation.mask), not a backend op


def _fake_bool_mask(mask, name):
    torch._check(mask.dtype != torch.bool, lambda: f"bool_mask: {name} is already bool")
    torch._check(
        not mask.dtype.is_complex, lambda: f"bool_mask: {name} must be a float or integer tensor, got {mask.dtype}"
    )
    return mask.new_empty(mask.shape, dtype=torch.bool)


register("bool_mask", _fake_bool_mask)
