"""Drop-in ppo_fast ops for OpenRLHF 0.11.x: ``patch()`` replaces its PPO functions in place.

::

    import ppo_fast.integrations.openrlhf as pf_orlhf
    pf_orlhf.patch()                     # in every process that builds actors, critics, experience

Replaced (module attribute and every alias in OpenRLHF's loaded modules, e.g. the names
``openrlhf.models.actor`` and ``openrlhf.trainer.ray.ppo_actor`` imported):

* ``openrlhf.models.utils.compute_approx_kl`` -> ``pf.kl_estimate`` (k1/k2/k3 clamped to
  [-10, 10] and computed in float32 as OpenRLHF does; ``unbiased_gradient`` keeps its
  straight-through k2 gradient with the clamped importance weight);
* ``openrlhf.models.utils.log_probs_from_logits`` -> ``pf.token_logprobs`` (OpenRLHF
  divides the logits by the temperature in place: so does the adapter);
* ``openrlhf.models.loss.PolicyLoss`` / ``ValueLoss`` -> subclasses whose ``forward`` runs
  ``pf.clipped_policy_loss`` / ``pf.value_loss`` with OpenRLHF's token- or
  sequence-level aggregation and its global normalisation (``dp_size``,
  ``batch_num_tokens``, ``global_batch_size``); GSPO and the train/rollout IS correction
  run OpenRLHF's own ``forward``;
* ``RemoteExperienceMaker.get_advantages_and_returns`` -> ``pf.gae`` with OpenRLHF's
  semantics: a masked token inside a response is a step with zero reward and zero value
  (ppo_fast's own ``gae`` skips it), so the adapter hands ``pf.gae`` the mask of each
  row's prefix up to its last valid token and the masked-out rewards and values.

Importing OpenRLHF's modules needs its GPU stack (flash-attn, DeepSpeed, vLLM); where
they are missing ``patch()`` raises ``ImportError`` naming the module.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

import torch

import ppo_fast as pf
from ppo_fast.spec import KL_ESTIMATORS

from . import _patching
from ._patching import PatchHandle, Target

PEER = "openrlhf"
DISTRIBUTION = "openrlhf"
SUPPORTED_VERSIONS = ("0.11",)

_NO_IGNORE = -(2**63)
_KL_ESTIMATORS = tuple(e for e in KL_ESTIMATORS if e != "abs")  # OpenRLHF has k1, k2 and k3
_KL_CLAMP = 10.0
_KL_IS_WEIGHT_CLIP = 10.0  # OpenRLHF's KL_IS_WEIGHT_CLIP

_MODULES = {
    "utils": "openrlhf.models.utils",
    "loss": "openrlhf.models.loss",
    "experience_maker": "openrlhf.trainer.ppo_utils.experience_maker",
}
_ORIG: dict[str, Any] = {}


def _module(key: str):
    import importlib

    return importlib.import_module(_MODULES[key])


def _count(name: str) -> None:
    _patching.count(f"{PEER}.{name}")


def _backend(op: str, tensor: torch.Tensor):
    return _patching.backend_for(PEER, op, tensor.device.type)


def _original(name: str):
    if name in _ORIG:
        return _ORIG[name]
    if name in ("PolicyLoss", "ValueLoss"):
        return getattr(_module("loss"), name)
    if name == "get_advantages_and_returns":
        return _module("experience_maker").RemoteExperienceMaker.get_advantages_and_returns
    return getattr(_module("utils"), name)


def _fallback(name: str, *args, **kwargs):
    _patching.count(f"{PEER}.{name}:fallback")
    return _original(name)(*args, **kwargs)


# --------------------------------------------------------------------------- KL, log-probs


def compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    log_probs_old: torch.Tensor | None = None,
    kl_estimator: str = "k1",
    unbiased_gradient: bool = False,
) -> torch.Tensor:
    """OpenRLHF's ``compute_approx_kl`` on ``pf.kl_estimate`` (float32, clamped to [-10, 10])."""
    if kl_estimator not in _KL_ESTIMATORS:
        raise ValueError(f"Unknown kl_estimator: {kl_estimator}")
    if log_probs.shape != log_probs_base.shape:
        return _fallback("compute_approx_kl", log_probs, log_probs_base, log_probs_old, kl_estimator, unbiased_gradient)
    _count("compute_approx_kl")
    logp, base = log_probs.float(), log_probs_base.float()
    with _backend("kl_estimate", logp):
        value = pf.kl_estimate(logp, base, kl_estimator).clamp(-_KL_CLAMP, _KL_CLAMP)
        if not unbiased_gradient:
            return value
        if log_probs_old is None:
            weight = 1.0
        else:
            weight = (logp - log_probs_old.float()).exp().clamp(max=_KL_IS_WEIGHT_CLIP).detach()
        surrogate = weight * pf.kl_estimate(logp, base, "k2")
    return value.detach() + surrogate - surrogate.detach()


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """OpenRLHF's ``log_probs_from_logits`` on ``pf.token_logprobs``, in the logits' dtype.

    Like OpenRLHF, a temperature other than 1 divides ``logits`` in place first (callers
    see the scaled logits afterwards)."""
    if labels.shape != logits.shape[:-1] or labels.dtype.is_floating_point:
        return _fallback("log_probs_from_logits", logits, labels, temperature)
    _count("log_probs_from_logits")
    if temperature != 1.0:
        logits.div_(temperature)
    with _backend("token_logprobs", logits):
        return pf.token_logprobs(logits, labels, ignore_index=_NO_IGNORE).to(logits.dtype)


# --------------------------------------------------------------------------- losses


def _ones_like_mask(x: torch.Tensor) -> torch.Tensor:
    return torch.ones(x.shape, dtype=torch.bool, device=x.device)


def _openrlhf_scale(loss, mask, token_level, dp_size, batch_num_tokens, global_batch_size):
    """OpenRLHF's ``aggregate_loss`` normalisation on top of our local aggregate: the
    same sums divided by the global token (or sample) count times ``dp_size`` when given,
    else by the local count (0/0 is NaN, as in OpenRLHF)."""
    if token_level:
        local = mask.sum().to(loss.dtype)  # a 0/1 mask (checked by the op): its sum counts the tokens
        denominator = local if batch_num_tokens is None else batch_num_tokens / dp_size
    else:
        local = (mask.sum(dim=-1) > 0).sum().to(loss.dtype)
        denominator = local if global_batch_size is None else global_batch_size / dp_size
    return loss * local / denominator


def _make_loss_classes(loss_module):
    PolicyLoss, ValueLoss = _make_policy_loss(loss_module.PolicyLoss), _make_value_loss(loss_module.ValueLoss)
    PolicyLoss.__qualname__ = PolicyLoss.__name__ = "PolicyLoss"
    ValueLoss.__qualname__ = ValueLoss.__name__ = "ValueLoss"
    PolicyLoss.__module__ = ValueLoss.__module__ = __name__
    return PolicyLoss, ValueLoss


def _make_policy_loss(OrigPolicyLoss):
    class PolicyLoss(OrigPolicyLoss):
        """OpenRLHF's PPO policy loss on ``pf.clipped_policy_loss`` (the same constructor;
        GSPO and the rollout IS correction run OpenRLHF's own forward)."""

        def forward(
            self,
            log_probs,
            old_log_probs,
            advantages,
            action_mask=None,
            rollout_log_probs=None,
            dp_size=1,
            batch_num_tokens=None,
            global_batch_size=None,
        ):
            args = (
                log_probs,
                old_log_probs,
                advantages,
                action_mask,
                rollout_log_probs,
                dp_size,
                batch_num_tokens,
                global_batch_size,
            )
            low, high = self.clip_eps_low, self.clip_eps_high
            ours = (
                self.policy_loss_type == "ppo"
                and self.is_correction_level == "off"
                and all(isinstance(x, Real) and math.isfinite(x) for x in (low, high))
                and 0.0 < low < 1.0
                and high > 0.0
                and log_probs.shape == old_log_probs.shape == advantages.shape
                and log_probs.dim() == 2
                and (action_mask is None or action_mask.shape == log_probs.shape)
            )
            if not ours:
                _patching.count(f"{PEER}.PolicyLoss:fallback")
                return OrigPolicyLoss.forward(self, *args)
            _count("PolicyLoss")
            mask = _ones_like_mask(log_probs) if action_mask is None else action_mask
            agg = "token-mean" if self.token_level_loss else "seq-mean-token-mean"
            with _backend("clipped_policy_loss", log_probs):
                loss, stats = pf.clipped_policy_loss(
                    log_probs,
                    old_log_probs,
                    advantages,
                    mask,
                    clip_eps_low=float(low),
                    clip_eps_high=float(high),
                    dual_clip=None if self.dual_clip is None else float(self.dual_clip),
                    agg=agg,
                )
            loss = _openrlhf_scale(loss, mask, self.token_level_loss, dp_size, batch_num_tokens, global_batch_size)
            dtype = torch.result_type(log_probs, advantages)
            return loss.to(dtype), stats["clipfrac"], stats["approx_kl"].to(dtype), None, None

    return PolicyLoss


def _make_value_loss(OrigValueLoss):
    class ValueLoss(OrigValueLoss):
        """OpenRLHF's (clipped) value loss on ``pf.value_loss`` (the same constructor)."""

        def forward(
            self,
            values,
            old_values,
            returns,
            action_mask=None,
            dp_size=1,
            batch_num_tokens=None,
            global_batch_size=None,
        ):
            args = (values, old_values, returns, action_mask, dp_size, batch_num_tokens, global_batch_size)
            clip = self.clip_eps
            ours = (
                (clip is None or (isinstance(clip, Real) and math.isfinite(clip) and clip > 0))
                and values.dim() == 2
                and values.shape == returns.shape
                and (clip is None or old_values.shape == values.shape)
                and (action_mask is None or action_mask.shape == values.shape)
            )
            if not ours:
                _patching.count(f"{PEER}.ValueLoss:fallback")
                return OrigValueLoss.forward(self, *args)
            _count("ValueLoss")
            mask = _ones_like_mask(values) if action_mask is None else action_mask
            agg = "token-mean" if self.token_level_loss else "seq-mean-token-mean"
            with _backend("value_loss", values):
                loss, _ = pf.value_loss(
                    values,
                    old_values if clip is not None else None,
                    returns,
                    mask,
                    clip=None if clip is None else float(clip),
                    agg=agg,
                )
            loss = _openrlhf_scale(loss, mask, self.token_level_loss, dp_size, batch_num_tokens, global_batch_size)
            return loss.to(torch.result_type(values, returns))

    return ValueLoss


# --------------------------------------------------------------------------- GAE


def prefix_mask(action_mask: torch.Tensor) -> torch.Tensor:
    """Each row's positions up to and including its last valid token (bool)."""
    m = action_mask if action_mask.dtype == torch.bool else action_mask != 0
    return m.flip(-1).cummax(dim=-1).values.flip(-1)


@torch.no_grad()
def get_advantages_and_returns(
    self, values: torch.Tensor, rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float, lambd: float
):
    """OpenRLHF's GAE on ``pf.gae``.

    OpenRLHF multiplies rewards and values by the mask and runs GAE over every position,
    so a masked token inside a response is a step with zero reward and zero value that is
    discounted through.  ``pf.gae`` skips masked tokens instead; to reproduce OpenRLHF the
    adapter passes the masked-out rewards and values and, as mask, each row's prefix up to
    its last valid token (after it OpenRLHF's advantages are 0 too).
    """
    gamma_f, lam_f = float(gamma), float(lambd)
    if not (0.0 <= gamma_f <= 1.0 and 0.0 <= lam_f <= 1.0) or values.shape != rewards.shape or values.dim() != 2:
        return _fallback("get_advantages_and_returns", self, values, rewards, action_mask, gamma, lambd)
    _count("get_advantages_and_returns")
    if action_mask is None:
        mask = _ones_like_mask(values)
    else:
        values, rewards = action_mask * values, action_mask * rewards
        mask = prefix_mask(action_mask)
    with _backend("gae", values):
        advantages, returns = pf.gae(rewards, values, mask, gamma=gamma_f, lam=lam_f)
    dtype = torch.result_type(values, rewards)
    return advantages.to(dtype), returns.to(dtype)


# --------------------------------------------------------------------------- patching

#: What ``patch()`` replaces (for documentation and tests).
REPLACED = {
    "openrlhf.models.utils": ("compute_approx_kl", "log_probs_from_logits"),
    "openrlhf.models.loss": ("PolicyLoss", "ValueLoss"),
    "openrlhf.trainer.ppo_utils.experience_maker": ("RemoteExperienceMaker.get_advantages_and_returns",),
}


def _targets() -> list[Target]:
    utils, loss, maker = _module("utils"), _module("loss"), _module("experience_maker")
    targets = []
    for name in ("compute_approx_kl", "log_probs_from_logits"):
        _ORIG[name] = getattr(utils, name)
        targets.append(Target(utils, name, globals()[name]))
    _ORIG["PolicyLoss"], _ORIG["ValueLoss"] = loss.PolicyLoss, loss.ValueLoss
    policy_loss, value_loss = _make_loss_classes(loss)
    targets += [Target(loss, "PolicyLoss", policy_loss), Target(loss, "ValueLoss", value_loss)]
    cls = maker.RemoteExperienceMaker
    _ORIG["get_advantages_and_returns"] = cls.__dict__["get_advantages_and_returns"]
    targets.append(Target(cls, "get_advantages_and_returns", get_advantages_and_returns))
    return targets


def patch(backend: str = "auto") -> PatchHandle:
    """Replace OpenRLHF's PPO functions by ppo_fast's, in place; returns a handle (a context manager).

    ``backend`` as in :func:`ppo_fast.integrations.verl.patch`.  Patching twice is
    harmless; an OpenRLHF other than 0.11.x raises :class:`UnsupportedPeerVersion`.
    """
    version = _patching.check_version(PEER, DISTRIBUTION, SUPPORTED_VERSIONS)
    for key in _MODULES:
        try:
            _module(key)
        except ImportError as err:
            raise ImportError(
                f"ppo_fast.integrations.openrlhf: cannot import {_MODULES[key]} ({type(err).__name__}: {err}); "
                "OpenRLHF's modules need its GPU stack (flash-attn, DeepSpeed, vLLM)"
            ) from err
    return _patching.install(PEER, "openrlhf", backend, version, _targets)


def unpatch() -> None:
    """Restore OpenRLHF's originals (whatever handles are still open)."""
    _patching.restore_all(PEER)


def is_patched() -> bool:
    return _patching.is_patched(PEER)


UnsupportedPeerVersion = _patching.UnsupportedPeerVersion
