"""Triton kernels and their launchers (no autograd; see ``ppo_fast.ops.triton_backend``).

Every kernel loads its inputs, converts them to float32 at once and computes in
float32 (bf16 arithmetic is also wrong under the Triton interpreter); float64
inputs are computed and returned in float64, as the reference does.  Float
hyper-parameters (temperature, kl_coef, gamma, lam) reach a kernel as float32
arguments (float64 under torch.compile), so each is passed as a float32 pair
``hi + lo`` (``_dtypes.split_scalar``): a float64 kernel rebuilds it to ~2**-48
relative and matches the reference to float64 rounding, a float32 kernel uses
``hi``, the hyper-parameter rounded to float32.

The launchers take inputs of any strides (sliced, transposed, expanded), check
shapes, launch on the inputs' device and never sync with the host; see
``_launch``.  Values at masked positions and ignored rows are never read into a
result or a gradient (the non-finite rule of ``ppo_fast.contract``).
"""

from .gae import gae_backward, gae_forward
from .group_sum import group_sum_forward
from .kl_reward import kl_backward, kl_estimate_forward, kl_penalized_rewards_backward, kl_penalized_rewards_forward
from .linear_logprobs import linear_logprobs_backward, linear_logprobs_forward
from .logprobs import token_logprobs_backward, token_logprobs_forward

__all__ = [
    "token_logprobs_forward",
    "token_logprobs_backward",
    "linear_logprobs_forward",
    "linear_logprobs_backward",
    "kl_estimate_forward",
    "kl_backward",
    "kl_penalized_rewards_forward",
    "kl_penalized_rewards_backward",
    "gae_forward",
    "gae_backward",
    "group_sum_forward",
]
