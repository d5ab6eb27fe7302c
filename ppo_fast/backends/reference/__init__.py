"""The reference backend: plain PyTorch, readable and differentiable, the oracle.

Every function takes inputs already validated and normalised by ``ppo_fast.ops`` (masks are
bool, shapes agree) and computes and returns in ``result_dtype`` of its floating inputs
(float32, float64 if any is float64).  The fast backends implement exactly these signatures
and the rules in ``ppo_fast.spec``: values at masked positions are replaced by 0 before any
arithmetic (so NaN/inf there reaches neither a result nor a gradient), and an out-of-range
label gives a NaN log-prob and no gradient.  It serves every op on every device.
"""

from ...spec import OPS
from .. import collect, op_modules

# Helpers of the other modules and of the tests, besides the ops.
from .aggregate import aggregate, aggregate_packed, masked_mean, masked_whiten, segment_scale  # noqa: E402
from .gae import gae_packed  # noqa: E402
from .kl_penalized_rewards import k3_of, last_valid_index  # noqa: E402
from .linear_token_logprobs import linear_logits  # noqa: E402
from .policy_loss import sequence_level_packed  # noqa: E402
from .rollout_correction import rollout_correction_weights  # noqa: E402
from .value_loss import value_loss_terms  # noqa: E402

MODULES = op_modules(__name__, __path__)
SUPPORTED, FUNCTIONS = collect(MODULES)
assert set(SUPPORTED) == set(OPS), f"ops without a reference: {sorted(set(OPS) - set(SUPPORTED))}"
globals().update(FUNCTIONS)  # reference.gae(...) etc.: the oracle's functions by name


def availability() -> tuple[bool, str]:
    return True, "plain PyTorch, every op on every device"


__all__ = [
    "SUPPORTED",
    "FUNCTIONS",
    "MODULES",
    "availability",
    "aggregate",
    "aggregate_packed",
    "segment_scale",
    "gae_packed",
    "sequence_level_packed",
    "value_loss_terms",
    "masked_mean",
    "masked_whiten",
    "k3_of",
    "last_valid_index",
    "linear_logits",
    "rollout_correction_weights",
    *FUNCTIONS,
]
