"""Public op: generalised advantage estimation."""

from __future__ import annotations

import torch

from .. import _validation as check
from .._varlen import backend_of, varlen
from ..backends import direct_op, reference, resolve

__all__ = ["gae"]


def _packed(segments, rewards, values, mask, *, gamma: float = 1.0, lam: float = 0.95):
    """``gae`` on the packed ``[N]`` tensors: one reverse scan per segment on every backend (the
    Triton kernels read the segments' bounds on the device: no host sync)."""
    rows = _checked(rewards[None], values[None], mask[None], gamma, lam)
    backend = backend_of("gae", rewards.device.type)
    if backend == "native":
        return torch.ops.ppo_fast.gae_varlen(*(x[0] for x in rows[:3]), segments.cu_seqlens, *rows[3:])
    if backend == "reference":
        return reference.gae_packed(segments, *(x[0] for x in rows[:3]), *rows[3:])
    if backend == "triton":  # the bound is the padded path's chunking where known on the host
        max_seqlen = segments.max_seqlen if isinstance(segments.max_seqlen, int) else None
        return torch.ops.ppo_fast_triton.gae_varlen(
            *(x[0] for x in rows[:3]), segments.cu_seqlens, max_seqlen, gamma=rows[3], lam=rows[4]
        )
    return NotImplemented


def _checked(rewards, values, mask, gamma, lam):
    check.tensor("rewards", rewards, ndim=2)
    check.tensor("values", values, ndim=2)
    check.same_shape("rewards", rewards, values=values)
    check.same_device(rewards=rewards, values=values, mask=mask)
    mask = check.mask("mask", mask, rewards.shape)
    gamma = check.real("gamma", gamma, low=0.0, high=1.0)
    lam = check.real("lam", lam, low=0.0, high=1.0)
    return rewards, values, mask, gamma, lam


@varlen("rewards", "values", "mask", packed=_packed)
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0, lam: float = 0.95):
    """Generalised advantage estimation over the valid tokens of each row.

    Args:
        rewards: ``[B, T]`` per-token rewards.
        values: ``[B, T]`` the critic's values.
        mask: ``[B, T]`` 1/True at valid tokens.  The valid tokens of a row, in
            order, are its episode: a masked token inside a row (e.g. a tool output)
            is skipped, not a terminal; the value after the last valid token is 0.
        gamma: discount in [0, 1].  lam: GAE lambda in [0, 1].

    Returns:
        ``(advantages, returns)`` float32 ``[B, T]`` with
        ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``
        and ``returns = advantages + values``; both 0 at masked positions, where
        rewards and values are ignored.
    """
    direct = direct_op("gae", rewards, mask)
    if direct is not None:
        try:
            return direct(
                rewards,
                values,
                mask,
                check.real("gamma", gamma, low=0.0, high=1.0),
                check.real("lam", lam, low=0.0, high=1.0),
            )
        except Exception:  # refused: the checks below name what
            pass
    return resolve("gae", rewards.device.type)(*_checked(rewards, values, mask, gamma, lam))
