"""Triton linear_policy_loss: the policy loss through the LM head in one pass over chunks of whole
sequences (``backends._one_pass.one_pass_on_rows``): the products by cuBLAS, each chunk's
log-softmax rows and their gradient by this backend's token_logprobs kernels, the gradient written
into the chunk's logits buffer; every mode whose per-token gradient is local to a sequence."""

from __future__ import annotations

from ...spec import POLICY_LOSS_MODES
from .._one_pass import RowKernels, rows_ops
from ._launch import DEVICES, device_guard
from .token_logprobs import token_logprobs_backward, token_logprobs_forward


def _forward(logits, labels, temperature, ignore_index):
    with device_guard(logits):
        return token_logprobs_forward(logits, labels, temperature, True, ignore_index)


def _backward(grad_logp, grad_entropy, logits, labels, stats, entropy, *, temperature, ignore_index):
    with device_guard(logits):
        return token_logprobs_backward(
            grad_logp,
            grad_entropy,
            logits,
            labels,
            stats,
            entropy,
            temperature=temperature,
            ignore_index=ignore_index,
            out=logits,
        )


_FUNCTIONS = rows_ops(
    "ppo_fast_triton", RowKernels(_forward, _backward), [m for m in POLICY_LOSS_MODES.values() if m.fused_head]
)
SUPPORTED = {op: DEVICES for op in _FUNCTIONS}
globals().update(_FUNCTIONS)


def static_variants() -> list[dict]:
    """None of its own for ``bench.static``: the loop launches token_logprobs' kernels, whose variants
    that module lists."""
    return []
