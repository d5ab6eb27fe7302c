"""Public ops: the policy loss of every registered mode (``ppo_fast.spec.POLICY_LOSS_MODES``) and
the PPO clipped surrogate (its vanilla mode)."""

from __future__ import annotations

import torch

from .. import _validation as check
from .._dtypes import result_dtype
from .._varlen import backend_of, one_row, varlen
from ..backends import direct_op, reference, resolve
from ..spec import AGG_MODES, POLICY_LOSS_MODES, PolicyLossMode, policy_loss_mode

__all__ = ["policy_loss", "policy_loss_modes", "clipped_policy_loss"]

# Bound mode parameters by (mode, given values): a training loop passes the same plain numbers
# every step, and binding them (checks, defaults) costs more host time than the loss's kernels on
# small batches.  Never under torch.compile: a symbolic number's check is a guard it must see.
_PLAIN = (float, int, type(None))
_BOUND: dict[tuple, tuple] = {}
_BOUND_MAX = 1024
_CLIP_NAMES = ("clip_eps_low", "clip_eps_high", "dual_clip")


def _bind(mode: PolicyLossMode, given: dict, eager: bool = False) -> tuple:
    """``mode.bind(given)``, cached; ``eager``: the caller knows it runs outside torch.compile."""
    return _bind_values(mode, tuple(given), tuple(given.values()), eager)


def _bind_values(mode: PolicyLossMode, names: tuple, values: tuple, eager: bool = False) -> tuple:
    """``_bind`` of ``dict(zip(names, values))``: the direct call's form, without building the dict
    (a loss's Python costs about three times its isolated time inside a forward + backward loop)."""
    for value in values:
        if type(value) not in _PLAIN:
            return mode.bind(dict(zip(names, values)))
    if not eager and torch.compiler.is_compiling():
        return mode.bind(dict(zip(names, values)))
    key = (mode.name, names, values)  # in the caller's order: another order is another entry
    bound = _BOUND.get(key)
    if bound is None:
        bound = mode.bind(dict(zip(names, values)))
        if len(_BOUND) < _BOUND_MAX:
            _BOUND[key] = bound
    return bound


def _row(x):
    return None if x is None else x[None]


def token_level_packed(segments, call, *, logprobs, old_logprobs, advantages, mask, weights, agg):
    """A token-level loss on the packed ``[N]`` tokens as one row: ``call(logprobs, old_logprobs,
    advantages, mask, weights, agg)`` on ``[1, N]``.  A ``seq-mean-*`` aggregation is the token sum
    of each token's loss times its sequence's factor (``reference.segment_scale``), carried in the
    weights: the value equals the padded layout's up to the order of its sums, and so do the gradients."""
    check.choice("agg", agg, AGG_MODES)
    bool_mask = check.mask("mask", mask, logprobs.shape)
    dtype = result_dtype(*(x for x in (logprobs, old_logprobs, advantages, weights) if isinstance(x, torch.Tensor)))
    scale = reference.segment_scale(segments, bool_mask, agg, dtype)
    if scale is not None:
        weights = scale if weights is None else weights * scale
        agg = "token-sum"
    return one_row(call(_row(logprobs), _row(old_logprobs), _row(advantages), bool_mask[None], _row(weights), agg))


def _policy_loss_packed(
    segments, logprobs, old_logprobs, advantages, mask, *, loss_mode="vanilla", agg=None, weights=None, **mode_params
):
    """``policy_loss`` on packed tokens: the token-level modes as one row (``token_level_packed``);
    GSPO and GMPO per segment on the reference and the native kernels (CPU, and CUDA where built:
    the segments' bounds read on the device)."""
    mode = policy_loss_mode(loss_mode)
    agg = mode.default_agg if agg is None else agg
    if not mode.sequence_level:

        def call(lp, old, adv, m, w, agg):
            return policy_loss(lp, old, adv, m, loss_mode=loss_mode, agg=agg, weights=w, **mode_params)

        return token_level_packed(
            segments,
            call,
            logprobs=logprobs,
            old_logprobs=old_logprobs,
            advantages=advantages,
            mask=mask,
            weights=weights,
            agg=agg,
        )
    backend = backend_of(mode.op, logprobs.device.type)
    if backend not in ("reference", "native"):
        return NotImplemented  # no segmented kernel there: the padded detour
    params = mode.bind(mode_params)
    inputs = {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages, "weights": weights}
    mask = check.loss_inputs({k: _row(x) for k, x in inputs.items()}, mask[None])[0]
    agg = check.choice("agg", agg, AGG_MODES)
    if backend == "native":  # csrc/policy_loss.cpp's segmented kernels (registered with the native backend)
        clip = mode.named(params)
        loss, *stats, _row_scale, _row_state = getattr(torch.ops.ppo_fast, f"{mode.op}_varlen")(
            logprobs,
            old_logprobs,
            advantages,
            mask,
            weights,
            segments.cu_seqlens,
            clip["clip_eps_low"],
            clip["clip_eps_high"],
            agg,
        )
        stats = [stat.detach() for stat in stats]
    else:
        loss, *stats = reference.sequence_level_packed(
            mode.op, segments, logprobs, old_logprobs, advantages, mask, weights, agg=agg, **mode.named(params)
        )
    return loss, dict(zip(mode.stats, stats))


def _clipped_policy_loss_packed(
    segments, logprobs, old_logprobs, advantages, mask, *, agg="token-mean", weights=None, **clip
):
    def call(lp, old, adv, m, w, agg):
        return clipped_policy_loss(lp, old, adv, m, agg=agg, weights=w, **clip)

    return token_level_packed(
        segments,
        call,
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        mask=mask,
        weights=weights,
        agg=agg,
    )


@varlen("logprobs", "old_logprobs", "advantages", "mask", "weights", packed=_policy_loss_packed)
def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_mode: str = "vanilla",
    agg: str | None = None,
    weights: torch.Tensor | None = None,
    **mode_params: float | None,
):
    """The policy loss (to minimise) of a registered mode, and its stats.

    Args:
        logprobs: ``[B, T]`` current log-probs of the sampled tokens.
        old_logprobs: ``[B, T]`` their log-probs at rollout.
        advantages: ``[B, T]`` their advantages.
        mask: ``[B, T]`` 1/True at valid response tokens.
        loss_mode: a name in ``pf.policy_loss_modes()`` (verl 0.9.1's ``loss_mode`` names).
        agg: one of ``token-mean``, ``token-sum``, ``seq-mean-token-sum``,
            ``seq-mean-token-mean``, ``seq-mean-token-sum-norm``; None: the mode's default
            (``token-mean``; ``seq-mean-token-mean`` for ``sapo`` and ``geo_mean``).
        weights: optional ``[B, T]`` per-token weights multiplying the per-token loss
            (e.g. ``pf.rollout_correction_weights``; ``geo_mean`` takes their geometric
            mean per row, as verl).
        **mode_params: the mode's parameters (``pf.policy_loss_modes()[mode].params``), e.g.
            ``clip_eps_low``, ``clip_eps_high``, ``dual_clip``, ``tau_pos``, ``dro_beta``.

    Returns:
        ``(loss, stats)``: a 0-dim loss (float32; float64 for float64 inputs),
        differentiable as the mode's formula is, and 0-dim detached stats named in the
        mode's ``stats`` (verl's ``pg_clipfrac``/``pg_clipfrac_lower``/``ppo_kl`` are
        ``clipfrac``/``clipfrac_lower``/``approx_kl``).
    """
    mode = policy_loss_mode(loss_mode)
    direct = direct_op(mode.op, logprobs, mask)
    if direct is not None:
        try:
            params = _bind(mode, mode_params)
            loss, *stats = direct(
                logprobs, old_logprobs, advantages, mask, weights, *params, mode.default_agg if agg is None else agg
            )
        except Exception:  # refused: the checks below name what
            pass
        else:
            return loss, dict(zip(mode.stats, stats))
    params = _bind(mode, mode_params)
    mask = check.loss_inputs(
        {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages, "weights": weights}, mask
    )
    agg = check.choice("agg", mode.default_agg if agg is None else agg, AGG_MODES)
    fn = resolve(mode.op, logprobs.device.type)
    loss, *stats = fn(logprobs, old_logprobs, advantages, mask, weights, agg=agg, **mode.named(params))
    return loss, dict(zip(mode.stats, stats))


_VANILLA = POLICY_LOSS_MODES["vanilla"]


def policy_loss_modes() -> dict[str, PolicyLossMode]:
    """The registered policy-loss modes by name: each entry's ``summary``, ``params`` (name,
    default, range), ``stats``, ``default_agg``, ``sequence_level`` and ``note`` (how it
    differs from verl's mode, if at all).  Which backends serve a mode: ``pf.available_backends()``
    and each backend's ``SUPPORTED[entry.op]``."""
    return dict(POLICY_LOSS_MODES)


@varlen("logprobs", "old_logprobs", "advantages", "mask", "weights", packed=_clipped_policy_loss_packed)
def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    weights: torch.Tensor | None = None,
):
    """PPO clipped surrogate loss (the quantity to minimise: ``-L_CLIP``).

    The ``vanilla`` mode of :func:`ppo_fast.policy_loss`.  Per token:
    ``ratio = exp(clamp(logp - old, -20, 20))``,
    ``pg = max(-A * ratio, -A * clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high))``
    (``clip_eps_high`` defaults to ``clip_eps_low``);
    with ``dual_clip = c > 1``, ``pg = min(pg, -A * c)`` where ``A < 0``; optional
    per-token ``weights`` multiply ``pg``.  ``agg`` is one of ``token-mean``,
    ``token-sum``, ``seq-mean-token-sum``, ``seq-mean-token-mean``,
    ``seq-mean-token-sum-norm`` (as verl defines them; empty selections give 0).

    Returns:
        ``(loss, stats)``: a 0-dim float32 loss, differentiable w.r.t. ``logprobs``,
        ``old_logprobs``, ``advantages`` and ``weights``, and 0-dim tensors ``clipfrac``,
        ``clipfrac_lower`` and ``approx_kl``.
    """
    direct = direct_op("clipped_policy_loss", logprobs, mask)
    if direct is not None:
        try:
            given = (clip_eps_low, clip_eps_high, dual_clip)
            low, high, dual = _bind_values(_VANILLA, _CLIP_NAMES, given, eager=True)  # direct_op: eager only
            loss, clipfrac, clipfrac_lower, approx_kl, _ = direct(
                logprobs, old_logprobs, advantages, mask, weights, low, high, dual, agg
            )
        except Exception:  # refused: the checks below name what
            pass
        else:
            return loss, {"clipfrac": clipfrac, "clipfrac_lower": clipfrac_lower, "approx_kl": approx_kl}
    mask = check.loss_inputs(
        {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages, "weights": weights}, mask
    )
    clip_eps_low, clip_eps_high, dual_clip = _bind(
        _VANILLA, {"clip_eps_low": clip_eps_low, "clip_eps_high": clip_eps_high, "dual_clip": dual_clip}
    )
    check.choice("agg", agg, AGG_MODES)
    fn = resolve("clipped_policy_loss", logprobs.device.type)
    loss, clipfrac, clipfrac_lower, approx_kl = fn(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        weights,
        clip_eps_low=clip_eps_low,
        clip_eps_high=clip_eps_high,
        dual_clip=dual_clip,
        agg=agg,
    )
    return loss, {"clipfrac": clipfrac, "clipfrac_lower": clipfrac_lower, "approx_kl": approx_kl}
