"""The public ops: validation and backend dispatch in front of reference/Triton/native implementations."""

from .advantages import gae, masked_mean, masked_whiten
from .group_advantages import advantage_methods, group_advantages
from .linear_logprobs import linear_token_logprobs
from .logprobs import token_logprobs
from .losses import clipped_policy_loss, value_loss
from .policy_loss import policy_loss, policy_loss_modes
from .rewards import kl_estimate, kl_penalized_rewards
from .rollout_correction import rollout_correction_weights

__all__ = [
    "token_logprobs",
    "linear_token_logprobs",
    "kl_estimate",
    "kl_penalized_rewards",
    "gae",
    "group_advantages",
    "advantage_methods",
    "masked_mean",
    "masked_whiten",
    "clipped_policy_loss",
    "policy_loss",
    "policy_loss_modes",
    "value_loss",
    "rollout_correction_weights",
]
