"""Public op: every registered policy-loss mode (``ppo_fast.policy_loss_modes``)."""

from __future__ import annotations

from .. import _validation as check
from ..backends import resolve
from ..contract import AGG_MODES
from ..policy_loss_modes import POLICY_LOSS_MODES, PolicyLossMode, policy_loss_mode
from .losses import _loss_inputs

__all__ = ["policy_loss", "policy_loss_modes"]


def policy_loss(logprobs, old_logprobs, advantages, mask, *, loss_mode="vanilla", agg=None, weights=None, **mode_params):
    """The policy loss (to minimise) of a registered mode, and its stats.

    Args:
        logprobs, old_logprobs, advantages: ``[B, T]`` current and rollout log-probs of the
            sampled tokens, and their advantages.
        mask: ``[B, T]`` 1/True at valid response tokens.
        loss_mode: a name in ``pf.policy_loss_modes()`` (verl 0.9.1's ``loss_mode`` names).
        agg: one of ``token-mean``, ``token-sum``, ``seq-mean-token-sum``,
            ``seq-mean-token-mean``, ``seq-mean-token-sum-norm``; None: the mode's default
            (``token-mean``; ``seq-mean-token-mean`` for ``sapo`` and ``geo_mean``).
        weights: optional ``[B, T]`` per-token weights multiplying the per-token loss
            (e.g. ``pf.rollout_correction_weights``; ``geo_mean`` takes their geometric
            mean per row, as verl).
        mode_params: the mode's parameters (``pf.policy_loss_modes()[mode].params``), e.g.
            ``clip_eps_low``, ``clip_eps_high``, ``dual_clip``, ``tau_pos``, ``dro_beta``.

    Returns:
        ``(loss, stats)``: a 0-dim loss (float32; float64 for float64 inputs),
        differentiable as the mode's formula is, and 0-dim detached stats named in the
        mode's ``stats`` (verl's ``pg_clipfrac``/``pg_clipfrac_lower``/``ppo_kl`` are
        ``clipfrac``/``clipfrac_lower``/``approx_kl``).
    """
    mode = policy_loss_mode(loss_mode)
    params = mode.bind(mode_params)
    mask = _loss_inputs(
        {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages, "weights": weights}, mask
    )
    agg = check.choice("agg", mode.default_agg if agg is None else agg, AGG_MODES)
    fn = resolve(mode.op, logprobs.device.type)
    loss, *stats = fn(logprobs, old_logprobs, advantages, mask, weights, *params, agg)
    return loss, dict(zip(mode.stats, stats))


def policy_loss_modes() -> dict[str, PolicyLossMode]:
    """The registered policy-loss modes by name: each entry's ``summary``, ``params`` (name,
    default, range), ``stats``, ``default_agg``, ``sequence_level`` and ``note`` (how it
    differs from verl's mode, if at all).  Which backends serve a mode: ``pf.available_backends()``
    and each backend's ``SUPPORTED[entry.op]``."""
    return dict(POLICY_LOSS_MODES)
