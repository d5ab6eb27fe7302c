"""The reference backend: plain PyTorch, readable and differentiable, the oracle.

Every function takes inputs already validated and normalised by ``ppo_fast.ops`` (masks are
bool, shapes agree) and computes and returns in ``result_dtype`` of its floating inputs
(float32, float64 if any is float64).  The fast backends implement exactly these signatures
and the rules in ``ppo_fast.spec``: values at masked positions are replaced by 0 before any
arithmetic (so NaN/inf there reaches neither a result nor a gradient), and an out-of-range
label gives a NaN log-prob and no gradient.  It serves every op on every device.
"""

from ...spec import OPS
from .aggregate import aggregate, masked_mean, masked_whiten
from .gae import gae
from .group_advantages import group_sum
from .kl_penalized_rewards import k3_of, kl_estimate, kl_penalized_rewards, last_valid_index
from .linear_token_logprobs import linear_logits, linear_token_logprobs
from .policy_loss import (
    clipped_policy_loss,
    policy_loss_cispo,
    policy_loss_clip_cov,
    policy_loss_dppo_kl,
    policy_loss_dppo_tv,
    policy_loss_dro,
    policy_loss_geo_mean,
    policy_loss_gpg,
    policy_loss_gspo,
    policy_loss_kl_cov,
    policy_loss_sapo,
)
from .rollout_correction import rollout_correction_weights
from .token_logprobs import token_logprobs
from .value_loss import value_loss

SUPPORTED = {op: {"cpu", "cuda"} for op in OPS}
FUNCTIONS = {op: globals()[op] for op in OPS}  # KeyError here: an op without a reference


def availability() -> tuple[bool, str]:
    return True, "plain PyTorch, every op on every device"


__all__ = ["aggregate", "masked_mean", "masked_whiten", "gae", "group_sum", "k3_of", "kl_estimate", "kl_penalized_rewards",
           "last_valid_index", "linear_logits", "linear_token_logprobs", "clipped_policy_loss", "policy_loss_cispo",
           "policy_loss_clip_cov", "policy_loss_dppo_kl", "policy_loss_dppo_tv", "policy_loss_dro", "policy_loss_geo_mean",
           "policy_loss_gpg", "policy_loss_gspo", "policy_loss_kl_cov", "policy_loss_sapo", "rollout_correction_weights",
           "token_logprobs", "value_loss", "SUPPORTED", "FUNCTIONS", "availability"]
