"""Triton kernels and their launchers (no autograd; see ``ppo_fast.ops.triton_backend``).

Every kernel loads its inputs, converts them to float32 at once and computes in
float32 (bf16 arithmetic is also wrong under the Triton interpreter); float64
inputs are computed and returned in float64, as the reference does.  Float
hyper-parameters (temperature, kl_coef, gamma, lam) are float32 kernel arguments
(float64 under torch.compile), cast to the compute type inside the kernels; so a
float64 result matches the reference to ~1e-7 relative in them unless they are
exactly representable in float32.
"""

from .gae import gae_backward, gae_forward
from .kl_reward import kl_backward, kl_estimate_forward, kl_penalized_rewards_forward
from .logprobs import token_logprobs_backward, token_logprobs_forward

__all__ = [
    "token_logprobs_forward",
    "token_logprobs_backward",
    "kl_estimate_forward",
    "kl_backward",
    "kl_penalized_rewards_forward",
    "gae_forward",
    "gae_backward",
]
