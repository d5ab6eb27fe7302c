"""The off-policy-correct loss (``--off-policy-loss``): which log-probs anchor the PPO ratio, and the
importance weights between the trainer's policy and the behaviour policy mu (the rollout engine's log-probs
of the tokens it sampled, under the distribution it sampled from).

* ``decoupled`` (AReaL's decoupled PPO; verl's default mode): the trainer recomputes pi_prox before the update
  in the update's first micro-batches (its ratio is exactly 1 there); the loss clips pi_theta / pi_prox, and
  ``--rollout-correction`` weighs each token by the truncated (TIS) or masked (MIS) pi_prox / mu.
* ``bypass`` (verl's bypass mode, TRL AsyncGRPO's): mu is pi_old, and the trainer's forward that would
  recompute it is skipped; the loss clips pi_theta / mu.  That ratio is already the whole importance ratio, so
  ``--rollout-correction`` reweighs it by ``w / r`` (``bypass_weights``), computed in each micro-batch from its
  own detached log-probs: TIS caps a token's importance weight at the threshold, MIS drops the tokens outside
  the band, and neither counts the ratio twice.

The decision is made here, once per step (``loss_inputs``), and once per micro-batch in bypass mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import ppo_fast as pf

# The engine-trainer mismatch metrics (mismatch_metrics), where the engine gives its log-probs mu and
# the trainer recomputes pi_old (absent under --off-policy-loss bypass; glossary: metric_glossary.py).
METRICS = {
    "rollout/logprob_diff_mean": "mean |log pi_old - log mu| of the sampled tokens (the trainer's against the engine's)",
    "rollout/logprob_diff_max": "max |log pi_old - log mu| of the sampled tokens",
    "rollout/kl": "mean k3 estimate of KL(engine || trainer) over the response tokens",
    "rollout/is_ratio_min": "min over the response tokens of the raw importance ratio pi_old / mu (before truncation)",
    "rollout/is_ratio_mean": "its mean",
    "rollout/is_ratio_max": "its max",
    "rollout/correction_weight_mean": "mean --rollout-correction weight over the response tokens",
    "rollout/is_corrected_frac": "share of response tokens whose raw ratio the correction truncated (*_tis) or "
    "masked (*_mis), per sequence for seq_*",
}

# Above the op's own clamp of the ratio (exp(20)): rollout_correction_weights with this threshold gives the raw,
# untruncated ratio, in the same arithmetic as the truncated one.
_NO_THRESHOLD = 1e30


@dataclass(frozen=True, kw_only=True)
class LossInputs:
    """What the update's loss takes from the rollouts: the log-probs its ratio is taken against, the per-token
    weights (None: none), and the step's off-policy metrics."""

    old_logprobs: torch.Tensor
    weights: torch.Tensor | None
    metrics: dict = field(default_factory=dict)


def recomputes_old(cfg) -> bool:
    """Whether the trainer scores pi_old itself before the update (not in bypass mode)."""
    return cfg.off_policy_loss != "bypass"


def weighs_each_micro_batch(cfg) -> bool:
    """Whether the weights are computed in each micro-batch from its log-probs (bypass with a correction):
    the update then takes the two-pass path, which has them (``update.loss_path``)."""
    return not recomputes_old(cfg) and cfg.rollout_correction != "none"


def loss_inputs(old: torch.Tensor | None, engine_logprobs: torch.Tensor | None, mask: torch.Tensor, cfg) -> LossInputs:
    """The loss's inputs for ``cfg.off_policy_loss``: ``old`` is the trainer's recomputed pi_old (None in bypass
    mode), ``engine_logprobs`` mu (None where the engine gives none), ``mask`` the response tokens."""
    if not recomputes_old(cfg):
        if engine_logprobs is None:
            raise ValueError("--off-policy-loss bypass needs the rollout engine's log-probs, and it gave none")
        return LossInputs(old_logprobs=engine_logprobs, weights=None)
    if engine_logprobs is None:
        return LossInputs(old_logprobs=old, weights=None)
    weights = None
    if cfg.rollout_correction != "none":
        weights = _correction(old, engine_logprobs, mask, cfg.rollout_correction, cfg.rollout_correction_threshold)
    metrics = mismatch_metrics(old, engine_logprobs, mask, weights, cfg.rollout_correction)
    return LossInputs(old_logprobs=old, weights=weights, metrics=metrics)


def bypass_weights(logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor, cfg) -> torch.Tensor:
    """Bypass mode's per-token weights for one micro-batch: ``w / r`` with ``r`` the raw ratio pi_theta / mu
    (per token, or per sequence for ``seq_*``) and ``w`` its ``--rollout-correction`` weight, both from the
    detached ``logprobs``.  The loss's ratio times ``w / r`` weighs a token by ``w``: at most the threshold
    (TIS), or 0 outside the band (MIS); 0 at masked positions."""
    mode = cfg.rollout_correction
    logprobs = logprobs.detach()
    raw = pf.rollout_correction_weights(logprobs, engine_logprobs, mask, mode=_raw_mode(mode), threshold=_NO_THRESHOLD)
    weights = _correction(logprobs, engine_logprobs, mask, mode, cfg.rollout_correction_threshold)
    return torch.where(mask, weights / raw, 0.0)  # raw >= exp(-20) > 0 at valid tokens


def _correction(old, engine_logprobs, mask, mode: str, threshold: float) -> torch.Tensor:
    return pf.rollout_correction_weights(old, engine_logprobs, mask, mode=mode, threshold=threshold)


def _raw_mode(mode: str) -> str:
    return "seq_tis" if mode.startswith("seq") else "token_tis"


def mismatch_metrics(
    trainer_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    mode: str = "token_tis",
) -> dict[str, float]:
    """How far the engine's log-probs of the sampled tokens (mu) are from the trainer's (pi_old), over the
    response tokens:

    * ``rollout/logprob_diff_mean`` and ``_max``: mean and max ``|pi_old - mu|`` in log space;
    * ``rollout/kl``: the k3 estimate of KL(engine || trainer), the mean over tokens (the engine sampled them);
    * ``rollout/is_ratio_min``, ``_mean``, ``_max``: the raw per-token importance ratio ``pi_old / mu`` before
      any truncation (a token both score -inf has ratio 1);
    * with ``weights`` (the ``--rollout-correction`` weights of ``mode``): ``rollout/correction_weight_mean``,
      and ``rollout/is_corrected_frac``, the fraction of tokens whose raw ratio the correction changed
      (truncated by ``*_tis``, masked by ``*_mis``; per sequence for ``seq_*``).
    """
    diff = (trainer_logprobs - engine_logprobs).abs()
    any_token = bool(mask.any())
    log_ratio = torch.where(trainer_logprobs == engine_logprobs, 0.0, trainer_logprobs - engine_logprobs)
    ratio = log_ratio.exp()
    row = {
        "rollout/logprob_diff_mean": pf.masked_mean(diff, mask).item(),
        "rollout/logprob_diff_max": diff.masked_fill(~mask, 0.0).max().item() if any_token else 0.0,
        "rollout/kl": pf.masked_mean(pf.kl_estimate(engine_logprobs, trainer_logprobs, "k3"), mask).item(),
        "rollout/is_ratio_min": ratio[mask].min().item() if any_token else 1.0,
        "rollout/is_ratio_mean": pf.masked_mean(ratio, mask).item(),
        "rollout/is_ratio_max": ratio[mask].max().item() if any_token else 1.0,
    }
    if weights is not None:
        raw = pf.rollout_correction_weights(
            trainer_logprobs, engine_logprobs, mask, mode=_raw_mode(mode), threshold=_NO_THRESHOLD
        )
        row["rollout/correction_weight_mean"] = pf.masked_mean(weights, mask).item()
        row["rollout/is_corrected_frac"] = pf.masked_mean((weights != raw).float(), mask).item()
    return row
