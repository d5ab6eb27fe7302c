"""The public ops, one module per op home: validation and backend dispatch in front of the
reference, Triton and native implementations (``ppo_fast.backends.<backend>.<op>``)."""

from .aggregate import aggregate, masked_mean, masked_whiten
from .gae import gae
from .group_advantages import advantage_methods, group_advantages
from .kl_penalized_rewards import kl_estimate, kl_penalized_rewards
from .linear_token_logprobs import linear_token_logprobs
from .policy_loss import clipped_policy_loss, policy_loss, policy_loss_modes
from .rollout_correction import rollout_correction_weights
from .token_logprobs import token_logprobs
from .value_loss import value_loss

__all__ = [
    "token_logprobs",
    "linear_token_logprobs",
    "kl_estimate",
    "kl_penalized_rewards",
    "gae",
    "group_advantages",
    "advantage_methods",
    "aggregate",
    "masked_mean",
    "masked_whiten",
    "clipped_policy_loss",
    "policy_loss",
    "policy_loss_modes",
    "value_loss",
    "rollout_correction_weights",
]
