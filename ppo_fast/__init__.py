"""ppo_fast: a kernel-accelerated PPO core for RLHF of language models.

Drop-in ops (all inputs ``[B, T]`` with a 1/True response mask unless said otherwise)::

    import ppo_fast as pf
    logp, ent = pf.token_logprobs(logits, labels, temperature=0.7, return_entropy=True)
    logp, ent = pf.linear_token_logprobs(hidden, lm_head.weight, labels, return_entropy=True)  # no [N, V] logits
    rewards, kl = pf.kl_penalized_rewards(scores, logp, ref_logp, mask, kl_coef=0.05)
    adv, ret = pf.gae(rewards, values, mask, gamma=1.0, lam=0.95)
    loss, stats = pf.clipped_policy_loss(logp, old_logp, pf.masked_whiten(adv, mask), mask)

Each op runs on the backend chosen by ``pf.use_backend`` / ``$PPO_FAST_BACKEND``
(``reference``, ``triton``, ``native`` or ``auto``); see ``pf.available_backends()``, and
``pf.backend_for(op, device)`` for the one an op would run on.
"""

import torch

from .spec import MIN_TORCH, older_than

if older_than(torch.__version__, MIN_TORCH):  # its custom ops, compiler and kernels differ: see docs/building.md
    raise ImportError(
        f"ppo_fast needs torch >= {MIN_TORCH}, found torch {torch.__version__}; "
        f"install a newer one, e.g. pip install 'torch>={MIN_TORCH}'"
    )

from . import ops  # noqa: E402
from .backends import BackendUnavailableError, available_backends, backend_for, current_backend, load_all, use_backend
from .kl_control import AdaptiveKLController, FixedKLController
from .ops import *  # noqa: F403  (ppo_fast.ops.__all__: every op module's public functions)

__version__ = "0.1.0"

load_all()

__all__ = [
    *ops.__all__,
    "AdaptiveKLController",
    "FixedKLController",
    "available_backends",
    "backend_for",
    "current_backend",
    "use_backend",
    "BackendUnavailableError",
]
