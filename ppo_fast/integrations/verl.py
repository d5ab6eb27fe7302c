"""Drop-in ppo_fast ops for verl 0.9.x: ``patch()`` replaces verl's own PPO functions in place.

::

    import ppo_fast.integrations.verl as pf_verl
    pf_verl.patch()                      # or: with pf_verl.patch(backend="native"): ...
    # ... verl runs as before; actor.policy_loss.loss_mode=ppo_fast also selects our loss

Replaced (module attribute, every alias in verl's loaded modules, and verl's registries):

* ``verl.trainer.ppo.core_algos``: ``compute_gae_advantage_return`` (``pf.gae`` +
  ``pf.masked_whiten``), ``compute_policy_loss_vanilla`` (``pf.clipped_policy_loss``;
  also registered as policy loss ``"ppo_fast"``), ``compute_value_loss``
  (``pf.value_loss``), ``agg_loss`` (``pf.aggregate``), ``kl_penalty`` and
  ``kl_penalty_forward`` (``pf.kl_estimate``, differentiable), ``AdaptiveKLController`` and
  ``FixedKLController`` (ours), and the outcome estimators ``compute_grpo_outcome_advantage``,
  ``compute_grpo_vectorized_outcome_advantage``, ``compute_rloo_outcome_advantage``,
  ``compute_rloo_vectorized_outcome_advantage`` (``pf.group_advantages``: ``grpo`` with
  verl's epsilon and ``norm_adv_by_std_in_grpo``, ``rloo`` with verl's rule for a group of one).
* ``verl.utils.torch_functional``: ``logprobs_from_logits`` and ``entropy_from_logits``
  (``pf.token_logprobs``), ``masked_mean``, ``masked_whiten``.

verl's conventions are kept around our ops: its global-batch normalisation
(``dp_size``, ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``), its
config objects, the dual clip it always applies (``clip_ratio_c``, 3.0 by default), its
GRPO epsilon (1e-6), its output dtypes, its errors (``masked_whiten`` of fewer than two
valid tokens, an unknown ``loss_agg_mode``).  Hyper-parameters outside our ops' domain
(e.g. ``clip_ratio_low >= 1``, ``cliprange_value <= 0``) go to verl's original function.
What still differs is listed in docs/integrations.md.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

import numpy as np
import torch

import ppo_fast as pf
from ppo_fast.spec import AGG_MODES

from . import _patching
from ._patching import PatchHandle, Target

PEER = "verl"
DISTRIBUTION = "verl"
SUPPORTED_VERSIONS = ("0.9",)
# Our loss under its own name: ``actor.policy_loss.loss_mode=ppo_fast``.
POLICY_LOSS_NAME = "ppo_fast"

# No label is ignored by verl's log-prob functions; a label no tensor can hold stands in.
_NO_IGNORE = -(2**63)

_ORIG: dict[str, Any] = {}


def _core():
    import verl.trainer.ppo.core_algos as core_algos

    return core_algos


def _functional():
    import verl.utils.torch_functional as verl_F

    return verl_F


def _count(name: str) -> None:
    _patching.count(f"{PEER}.{name}")


def _original(name: str):
    """verl's own function ``name`` (the module attribute when nothing is patched)."""
    if name in _ORIG:
        return _ORIG[name]
    return getattr(_core() if name in _CORE_FUNCTIONS else _functional(), name)


def _fallback(name: str, *args, **kwargs):
    _patching.count(f"{PEER}.{name}:fallback")
    return _original(name)(*args, **kwargs)


def _backend(op: str, tensor: torch.Tensor):
    return _patching.backend_for(PEER, op, tensor.device.type)


def _promote(*tensors) -> torch.dtype:
    """The dtype verl's eager arithmetic gives these inputs (float32 for integer/bool-only inputs)."""
    dtype = None
    for t in tensors:
        if isinstance(t, torch.Tensor):
            dtype = t.dtype if dtype is None else torch.promote_types(dtype, t.dtype)
    if dtype is None or not dtype.is_floating_point:
        return torch.get_default_dtype() if dtype is None else torch.promote_types(dtype, torch.get_default_dtype())
    return dtype


def _as_float(x) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


# --------------------------------------------------------------------------- aggregation


def _check_agg_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")


def _global_scale(
    loss, mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None, *, loss_scale_factor=None
):
    """verl's global-batch normalisation on top of our local aggregate ``loss``.

    Our ops normalise by the micro-batch (``token-mean``: its valid tokens;
    ``seq-mean-*``: its non-empty rows; ``-norm``: also by T).  verl divides the same sums
    by the global counts when given and multiplies by ``dp_size`` (FSDP averages the
    gradients over ranks), so the loss is rescaled by ``local count / global count *
    dp_size``.  Without a global count verl divides by the local one, and 0/0 is NaN as
    in verl.  Tensor arithmetic only: no host sync.
    """
    if loss_agg_mode == "token-sum":
        return loss * dp_size
    if loss_agg_mode == "token-mean":
        local = mask.sum().to(loss.dtype)  # a 0/1 mask (checked by the op): its sum counts the tokens
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            denominator = local
        else:
            denominator = batch_num_tokens
        return loss * local / denominator * dp_size
    local = (mask.sum(dim=-1) > 0).sum().to(loss.dtype)
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        denominator = local
    else:
        denominator = global_batch_size
    loss = loss * local / denominator * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm" and loss_scale_factor is not None:
        loss = loss * (mask.shape[-1] / loss_scale_factor)  # ours divided by T, verl by the factor
    return loss


def _agg_dtype(mode: str, *tensors) -> torch.dtype:
    """The dtype verl's ``agg_loss`` returns: its inputs' (``_promote``); the seq-mean modes
    divide by a float32 row mask (``(...).float()``), so at least float32 there."""
    dtype = _promote(*tensors)
    return torch.promote_types(dtype, torch.float32) if mode.startswith("seq-mean") else dtype


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, T]``: verl reduces over the last dim, then over everything else
    (a 1-D loss is one sequence), so the row split of the leading dims does not matter."""
    if x.dim() == 2:
        return x
    return x.reshape(1, -1) if x.dim() == 1 else x.flatten(0, -2)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
    loss_scale_factor: int | None = None,
):
    """verl's ``agg_loss`` on ``pf.aggregate`` (values at masked positions are never read),
    with verl's global normalisation and output dtype."""
    _check_agg_mode(loss_agg_mode)
    if loss_mask.shape != loss_mat.shape or loss_mat.dim() == 0:
        return _fallback(
            "agg_loss",
            loss_mat,
            loss_mask,
            loss_agg_mode,
            dp_size,
            batch_num_tokens,
            global_batch_size,
            loss_scale_factor,
        )
    _count("agg_loss")
    mat, mask = _token_rows(loss_mat), _token_rows(loss_mask)
    local = pf.aggregate(mat, mask, loss_agg_mode)
    out = _global_scale(
        local, mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor=loss_scale_factor
    )
    return out.to(_agg_dtype(loss_agg_mode, loss_mat, loss_mask))


# --------------------------------------------------------------------------- losses


def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's vanilla PPO loss on ``pf.clipped_policy_loss``: asymmetric clip from the actor
    config, the dual clip verl always applies (``clip_ratio_c``), rollout IS weights as
    per-token weights, verl's aggregation and global normalisation, verl's metrics."""
    from verl.trainer.config import AlgoConfig

    assert config is not None
    assert not isinstance(config, AlgoConfig)
    clip_ratio = config.clip_ratio
    clip_low = config.clip_ratio_low if config.clip_ratio_low is not None else clip_ratio
    clip_high = config.clip_ratio_high if config.clip_ratio_high is not None else clip_ratio
    clip_ratio_c = config.get("clip_ratio_c", 3.0)
    assert clip_ratio_c > 1.0, (
        "The lower bound of the clip_ratio_c for dual-clip PPO should be greater than 1.0,"
        + f" but get the value: {clip_ratio_c}."
    )
    _check_agg_mode(loss_agg_mode)
    args = (old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
    in_domain = all(isinstance(x, Real) and math.isfinite(x) for x in (clip_low, clip_high, clip_ratio_c)) and (
        0.0 < clip_low < 1.0 and clip_high > 0.0
    )
    if not in_domain or (rollout_is_weights is not None and rollout_is_weights.shape != log_prob.shape):
        return _fallback("compute_policy_loss_vanilla", *args)
    _count("compute_policy_loss_vanilla")
    with _backend("clipped_policy_loss", log_prob):
        loss, stats = pf.clipped_policy_loss(
            log_prob,
            old_log_prob,
            advantages,
            response_mask,
            clip_eps_low=float(clip_low),
            clip_eps_high=float(clip_high),
            dual_clip=float(clip_ratio_c),
            agg=loss_agg_mode,
            weights=rollout_is_weights,
        )
    global_info = dict(getattr(config, "global_batch_info", None) or {})
    loss = _global_scale(loss, response_mask, loss_agg_mode, **global_info)
    loss = loss.to(_agg_dtype(loss_agg_mode, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights))
    metrics = {
        "actor/pg_clipfrac": stats["clipfrac"].item(),
        "actor/ppo_kl": stats["approx_kl"].item(),
        "actor/pg_clipfrac_lower": stats["clipfrac_lower"].item(),
    }
    return loss, metrics


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
    loss_scale_factor: int | None = None,
):
    """verl's clipped value loss on ``pf.value_loss``, with verl's global normalisation."""
    args = (
        vpreds,
        returns,
        values,
        response_mask,
        cliprange_value,
        loss_agg_mode,
        dp_size,
        batch_num_tokens,
        global_batch_size,
        loss_scale_factor,
    )
    _check_agg_mode(loss_agg_mode)
    if not (isinstance(cliprange_value, Real) and math.isfinite(cliprange_value) and cliprange_value > 0):
        return _fallback("compute_value_loss", *args)
    _count("compute_value_loss")
    with _backend("value_loss", vpreds):
        loss, stats = pf.value_loss(
            vpreds, values, returns, response_mask, clip=float(cliprange_value), agg=loss_agg_mode
        )
    loss = _global_scale(
        loss,
        response_mask,
        loss_agg_mode,
        dp_size,
        batch_num_tokens,
        global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    # verl's clip fraction is a masked mean of a float32 indicator
    clipfrac_dtype = torch.promote_types(torch.float32, _promote(response_mask))
    return loss.to(_agg_dtype(loss_agg_mode, vpreds, returns, values, response_mask)), stats["clipfrac"].to(
        clipfrac_dtype
    )


# --------------------------------------------------------------------------- KL


_KL_NAMES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


def kl_penalty_forward(logprob: torch.FloatTensor, ref_logprob: torch.FloatTensor, kl_penalty) -> torch.FloatTensor:
    """verl's per-token KL estimate on ``pf.kl_estimate`` (differentiable; ``full`` is not implemented, as in verl)."""
    estimator = _KL_NAMES.get(kl_penalty)
    if estimator is None:  # verl raises NotImplementedError for "full" and unknown names too
        raise NotImplementedError(f"kl_penalty={kl_penalty!r} is not implemented (verl implements {sorted(_KL_NAMES)})")
    if logprob.shape != ref_logprob.shape:
        return _fallback("kl_penalty_forward", logprob, ref_logprob, kl_penalty)
    _count("kl_penalty_forward")
    with _backend("kl_estimate", logprob):
        return pf.kl_estimate(logprob, ref_logprob, estimator).to(_promote(logprob, ref_logprob))


def kl_penalty(logprob: torch.FloatTensor, ref_logprob: torch.FloatTensor, kl_penalty) -> torch.FloatTensor:
    """verl's ``kl_penalty``: the estimate, and with a ``+`` suffix (``k3+``) the k2
    gradient through a straight-through estimator, both on ``pf.kl_estimate``."""
    _count("kl_penalty")
    base = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
    forward_score = kl_penalty_forward(logprob, ref_logprob, base)
    if not kl_penalty.endswith("+") or kl_penalty in ("mse", "k2"):
        return forward_score
    with _backend("kl_estimate", logprob):
        backward_score = pf.kl_estimate(logprob, ref_logprob, "k2").to(forward_score.dtype)
    return backward_score - backward_score.detach() + forward_score.detach()


class AdaptiveKLController(pf.AdaptiveKLController):
    """ppo_fast's adaptive KL controller with verl's signature (``current_kl`` may be a
    tensor or numpy scalar, ``n_steps`` a numpy integer)."""

    def update(self, current_kl, n_steps):
        super().update(_as_float(current_kl), int(n_steps))


class FixedKLController(pf.FixedKLController):
    """ppo_fast's fixed KL controller with verl's signature."""


# --------------------------------------------------------------------------- advantages


def _whiten_checks(mask: torch.Tensor) -> None:
    """verl's ``masked_var`` refuses fewer than two valid entries (a host sync, as in verl)."""
    valid = int(mask.sum())
    if valid == 0:
        raise ValueError("At least one element in the mask has to be 1.")
    if valid == 1:
        raise ValueError("The sum of the mask is one, which can cause a division by zero.")


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: torch.Tensor,
    lam: torch.Tensor,
):
    """verl's GAE on ``pf.gae`` (observation tokens inside a row are skipped, as in verl),
    then verl's whitening of the advantages on ``pf.masked_whiten``."""
    gamma_f, lam_f = _as_float(gamma), _as_float(lam)
    if not (0.0 <= gamma_f <= 1.0 and 0.0 <= lam_f <= 1.0) or values.shape != token_level_rewards.shape:
        return _fallback("compute_gae_advantage_return", token_level_rewards, values, response_mask, gamma, lam)
    _count("compute_gae_advantage_return")
    with torch.no_grad():
        with _backend("gae", values):
            advantages, returns = pf.gae(token_level_rewards, values, response_mask, gamma=gamma_f, lam=lam_f)
        valid = response_mask if response_mask.dtype == torch.bool else response_mask != 0  # checked 0/1 by pf.gae
        _whiten_checks(valid)
        advantages = pf.masked_whiten(advantages, valid, eps=1e-8)
        dtype = _promote(token_level_rewards, values, response_mask)
    return advantages.to(dtype), returns.to(dtype)


def _group_ids(index, device) -> torch.Tensor:
    """verl's ``index`` (numpy array of prompt ids of any type, list, or tensor) as integer group ids."""
    if isinstance(index, torch.Tensor):
        return torch.unique(index.reshape(-1), return_inverse=True)[1].to(device)
    inverse = np.unique(np.asarray(index), return_inverse=True)[1]
    return torch.from_numpy(inverse.reshape(-1).astype(np.int64)).to(device)


def _outcome_advantages(token_level_rewards, response_mask, index, method, **params):
    """verl's outcome estimators on ``pf.group_advantages``.  verl's score is the sum of every
    token's reward (masked or not), its advantage that score's, times ``response_mask``:
    so the op gets the ``[B]`` scores and one valid token per row, and the product is verl's.
    The group statistics run in float64 (a [B] vector: cheap), so that near-equal scores
    keep a std epsilon can be compared with."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        one_token = torch.ones(scores.shape[0], 1, dtype=torch.bool, device=scores.device)
        with _backend("group_sum", scores):
            adv = pf.group_advantages(
                scores.double(), _group_ids(index, scores.device), one_token, method=method, **params
            )
        adv = adv.to(scores.dtype) * response_mask
    return adv, adv


def _grpo(name, token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo, *, config):
    if not (isinstance(epsilon, Real) and math.isfinite(epsilon) and epsilon >= 0):
        return _fallback(name, token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo, config)
    _count(name)
    return _outcome_advantages(
        token_level_rewards,
        response_mask,
        index,
        "grpo",
        epsilon=float(epsilon),
        norm_by_std=bool(norm_adv_by_std_in_grpo),
    )


def compute_grpo_outcome_advantage(
    token_level_rewards, response_mask, index, epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True, config=None
):
    """verl's GRPO outcome advantage on ``pf.group_advantages(method="grpo")`` (a group of one:
    mean 0, std 1, as both verl and ours)."""
    return _grpo(
        "compute_grpo_outcome_advantage",
        token_level_rewards,
        response_mask,
        index,
        epsilon,
        norm_adv_by_std_in_grpo,
        config=config,
    )


def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards, response_mask, index, epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True, config=None
):
    """verl's vectorised GRPO outcome advantage (the same definition as the loop version)."""
    return _grpo(
        "compute_grpo_vectorized_outcome_advantage",
        token_level_rewards,
        response_mask,
        index,
        epsilon,
        norm_adv_by_std_in_grpo,
        config=config,
    )


def compute_rloo_outcome_advantage(
    token_level_rewards, response_mask, index, epsilon: float = 1e-6, config=None, **kwargs
):
    """verl's RLOO on ``pf.group_advantages(method="rloo")``: a prompt with one response keeps its score."""
    _count("compute_rloo_outcome_advantage")
    return _outcome_advantages(token_level_rewards, response_mask, index, "rloo")


def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards, response_mask, index, epsilon: float = 1e-6, config=None, **kwargs
):
    """verl's vectorised RLOO: a prompt with one response gets 0 (``zero_singletons``)."""
    _count("compute_rloo_vectorized_outcome_advantage")
    return _outcome_advantages(token_level_rewards, response_mask, index, "rloo", zero_singletons=True)


# --------------------------------------------------------------------------- torch_functional


def _flash_ce_path() -> bool:
    """Whether verl's own ``logprobs_from_logits`` would take flash-attn's cross-entropy here."""
    import os

    verl_F = _functional()
    return (
        bool(getattr(verl_F, "FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE", False))
        and os.environ.get("VERL_DISABLE_FLASH_ATTN_CE", "0") != "1"
    )


def logprobs_from_logits(logits, labels, inplace_backward=True):
    """verl's ``logprobs_from_logits`` on ``pf.token_logprobs``.

    The dtype and ``inplace_backward`` follow the path verl would take here: with
    flash-attn's cross-entropy (a GPU with flash-attn) float32 log-probs and the gradient
    written into the logits when ``inplace_backward``; otherwise (verl's row loop) the
    logits' dtype and no in-place backward.
    """
    if labels.shape != logits.shape[:-1] or labels.dtype.is_floating_point:
        return _fallback("logprobs_from_logits", logits, labels, inplace_backward)
    _count("logprobs_from_logits")
    flash = _flash_ce_path()
    with _backend("token_logprobs", logits):
        logp = pf.token_logprobs(
            logits, labels, ignore_index=_NO_IGNORE, inplace_backward=bool(inplace_backward and flash)
        )
    return logp if flash else logp.to(logits.dtype)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """verl's ``entropy_from_logits`` on ``pf.token_logprobs(..., return_entropy=True)``, in the logits' dtype."""
    _count("entropy_from_logits")
    labels = torch.zeros((), dtype=torch.long, device=logits.device).expand(logits.shape[:-1])
    with _backend("token_logprobs", logits):
        _, entropy = pf.token_logprobs(logits, labels, return_entropy=True)
    return entropy.to(logits.dtype)


def masked_mean(values, mask, axis=None):
    """verl's ``masked_mean`` on ``pf.masked_mean`` (0/1 or bool masks of the values' shape)."""
    if not isinstance(mask, torch.Tensor) or mask.shape != values.shape:
        return _fallback("masked_mean", values, mask, axis)
    _count("masked_mean")
    out = pf.masked_mean(values, mask, dim=axis)
    dtype = torch.result_type(values, mask)
    if not mask.dtype.is_floating_point:  # verl divides by an integer count + 1e-8 (a default-dtype float)
        dtype = torch.promote_types(dtype, torch.get_default_dtype())
    return out.to(dtype)


def masked_whiten(values, mask, shift_mean=True):
    """verl's ``masked_whiten`` on ``pf.masked_whiten`` (eps 1e-8, Bessel-corrected; fewer
    than two valid entries raise ``ValueError`` as in verl)."""
    if not isinstance(mask, torch.Tensor) or mask.shape != values.shape:
        return _fallback("masked_whiten", values, mask, shift_mean)
    _count("masked_whiten")
    _whiten_checks(mask)
    return pf.masked_whiten(values, mask, shift_mean=bool(shift_mean), eps=1e-8).to(values.dtype)


# --------------------------------------------------------------------------- patching

_CORE_FUNCTIONS = (
    "compute_gae_advantage_return",
    "compute_policy_loss_vanilla",
    "compute_value_loss",
    "agg_loss",
    "kl_penalty",
    "kl_penalty_forward",
    "AdaptiveKLController",
    "FixedKLController",
    "compute_grpo_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
)
_FUNCTIONAL_FUNCTIONS = ("logprobs_from_logits", "entropy_from_logits", "masked_mean", "masked_whiten")
_ESTIMATORS = {
    "gae": "compute_gae_advantage_return",
    "grpo": "compute_grpo_outcome_advantage",
    "grpo_vectorized": "compute_grpo_vectorized_outcome_advantage",
    "rloo": "compute_rloo_outcome_advantage",
    "rloo_vectorized": "compute_rloo_vectorized_outcome_advantage",
}

#: What ``patch()`` replaces, as ``module: names`` (for documentation and tests).
REPLACED = {
    "verl.trainer.ppo.core_algos": _CORE_FUNCTIONS,
    "verl.utils.torch_functional": _FUNCTIONAL_FUNCTIONS,
}


def _targets() -> list[Target]:
    core, verl_F = _core(), _functional()
    ours = globals()
    targets = []
    for name in _CORE_FUNCTIONS:
        _ORIG[name] = getattr(core, name)
        targets.append(Target(core, name, ours[name]))
    for name in _FUNCTIONAL_FUNCTIONS:
        _ORIG[name] = getattr(verl_F, name)
        targets.append(Target(verl_F, name, ours[name]))
    # verl's trainers look functions up in its registries, not by attribute.
    if core.POLICY_LOSS_REGISTRY.get("vanilla") is _ORIG["compute_policy_loss_vanilla"]:
        targets.append(Target(core.POLICY_LOSS_REGISTRY, "vanilla", compute_policy_loss_vanilla, item=True))
    for key, name in _ESTIMATORS.items():
        if core.ADV_ESTIMATOR_REGISTRY.get(key) is _ORIG[name]:
            targets.append(Target(core.ADV_ESTIMATOR_REGISTRY, key, ours[name], item=True))
    return targets


def _added():
    return [(_core().POLICY_LOSS_REGISTRY, POLICY_LOSS_NAME, compute_policy_loss_vanilla)]


def patch(backend: str = "auto") -> PatchHandle:
    """Replace verl's PPO functions by ppo_fast's, in place; returns a handle (a context manager).

    ``backend``: ``"auto"`` follows ppo_fast's own choice (``pf.use_backend``,
    ``$PPO_FAST_BACKEND``); a backend name runs every op it serves on it (the others on
    ``auto``).  Patching twice is harmless.  Raises :class:`UnsupportedPeerVersion` for a
    verl other than 0.9.x.
    """
    version = _patching.check_version(PEER, DISTRIBUTION, SUPPORTED_VERSIONS)
    return _patching.install(PEER, "verl", backend, version, _targets, _added)


def unpatch() -> None:
    """Restore verl's originals (whatever handles are still open)."""
    _patching.restore_all(PEER)


def is_patched() -> bool:
    return _patching.is_patched(PEER)


UnsupportedPeerVersion = _patching.UnsupportedPeerVersion
