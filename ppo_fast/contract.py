"""The contract every backend implements, in one place: the op names, the KL estimators,
the aggregation modes and the result-dtype rule.

The reference (``ppo_fast.reference``), the Triton kernels, the native backend's glue
(whose C++ schemas take the estimator and ``agg`` as strings, parsed in
``csrc/contract.h``), the public ops and the trainer all import these names from here.

Rules every backend follows (tested by ``tests/test_conformance.py``):

* **Results** are float32, or float64 when any floating input is float64 (so that
  gradients can be checked numerically); see :func:`result_dtype`.
* **Non-finite values.** A value at a masked position (mask 0/False, or a label equal
  to ``ignore_index``) is never read into a result or a gradient: NaN/inf there is
  ignored.  A NaN at a valid position propagates to the outputs it feeds.
* **Out-of-range labels.** A label outside ``[0, V)`` that is not ``ignore_index``
  raises ``ValueError`` where checking costs no host sync (CPU tensors, eager mode).
  On CUDA and under ``torch.compile`` it is not checked on the host; every kernel then
  gives that row a NaN log-prob (and NaN entropy) and a zero gradient, and never reads
  or writes outside the logits.
"""

from __future__ import annotations

import torch

from .policy_loss_modes import POLICY_LOSS_OPS

# The public ops that have one implementation per backend.
OPS = (
    "token_logprobs",
    "linear_token_logprobs",
    "kl_estimate",
    "kl_penalized_rewards",
    "gae",
    "clipped_policy_loss",
    "value_loss",
    "group_sum",  # the reduction of the group advantage estimators (ppo_fast.advantage_estimators)
)
# Each policy-loss mode of the registry (ppo_fast.policy_loss_modes) is an op of its own, so
# that a backend declares the modes it serves one by one (vanilla is clipped_policy_loss).
OPS = OPS + tuple(op for op in POLICY_LOSS_OPS if op not in OPS)

# Per-token estimators of KL(pi || pi_ref) from the sampled tokens' log-probs.
KL_ESTIMATORS = ("k1", "k2", "k3", "abs")

# How a [B, T] per-token loss is reduced over the mask (verl's ``agg_loss`` names).
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# Rollout-correction weights (importance sampling between the rollout engine's and the
# trainer's log-probs): per token or per sequence, truncated (TIS) or masked (MIS, IcePop).
ROLLOUT_CORRECTION_MODES = ("token_tis", "seq_tis", "token_mis", "seq_mis")


def result_dtype(*inputs: torch.Tensor | None) -> torch.dtype:
    """The dtype every backend computes and returns in: float64 if any input is float64
    (so that gradients can be checked numerically), else float32."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in inputs) else torch.float32
