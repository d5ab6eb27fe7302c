"""Drop-in ppo_fast ops for TRL 1.x: ``patch()`` replaces TRL's log-prob functions in place.

::

    import ppo_fast.integrations.trl as pf_trl
    pf_trl.patch()                       # before building the trainer
    trainer = GRPOTrainer(...); trainer.train()

Replaced in ``trl.trainer.utils`` (and every alias in TRL's loaded modules):

* ``selective_log_softmax``, ``entropy_from_logits``, ``selective_log_softmax_and_entropy``
  -> ``pf.token_logprobs`` (``return_entropy=True``), in the dtype TRL returns (the logits'
  dtype on TRL's PyTorch path, float32 where TRL would run its own Triton kernel);
* the fused LM head's ``ChunkedLogProbFunction`` (what ``add_fused_lm_head`` calls: the
  log-probs and entropy of ``hidden @ weight.T`` that GRPOTrainer, RLOOTrainer, DPOTrainer,
  SFTTrainer and KTOTrainer use) -> row chunks of logits fed to ``pf.token_logprobs``, the
  logits recomputed in the backward (never all of ``[N, V]`` at once).

TRL 1.16 exposes no GRPO/PPO loss helper as a function (GRPOTrainer's loss is inline in
``_compute_loss``), so no loss is replaced.  What still differs is listed in
the README ("Drop-in integrations").
"""

from __future__ import annotations

from typing import Any

import torch

import ppo_fast as pf

from . import _patching
from ._patching import PatchHandle, Target

PEER = "trl"
DISTRIBUTION = "trl"
SUPPORTED_VERSIONS = ("1",)

_NO_IGNORE = -(2**63)
_MIN_TEMPERATURE = 1e-5
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Logits per row chunk of the fused LM head: 2^24 floats (64 MiB in float32).
LM_HEAD_CHUNK_ELEMENTS = 1 << 24
# Outputs of TRL's fused head: log-probs and entropy from our op; the three statistics without
# gradient (SFT, DPO and KTO ask for some) from the same chunk of logits, in torch.
_OUR_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
_STATS = ("log_sum_sq_probs", "mean_logits", "is_top1")

_ORIG: dict[str, Any] = {}


def _utils():
    import trl.trainer.utils as trl_utils

    return trl_utils


def _original(name: str):
    return _ORIG[name] if name in _ORIG else getattr(_utils(), name)


def _count(name: str) -> None:
    _patching.count(f"{PEER}.{name}")


def _fallback(name: str, *args, **kwargs):
    _patching.count(f"{PEER}.{name}:fallback")
    return _original(name)(*args, **kwargs)


def _backend(tensor: torch.Tensor):
    return _patching.backend_for(PEER, "token_logprobs", tensor.device.type)


def _trl_dtype(logits, index=None, row_mask=None) -> torch.dtype:
    """The dtype TRL's own function returns here: float32 from its Triton kernel (CUDA/XPU
    with Triton), else the logits' dtype (its PyTorch path).  Uses TRL's own predicate."""
    utils = _utils()
    try:
        kernel = utils.is_triton_available() and utils._supports_trl_loss_kernel(logits, index, row_mask)
    except Exception:  # a TRL without the predicate: its PyTorch path
        kernel = False
    return torch.float32 if kernel else logits.dtype


def _ours_can(logits, index, temperature, row_mask) -> bool:
    return (
        isinstance(logits, torch.Tensor)
        and logits.dtype in _LOGIT_DTYPES
        and logits.dim() >= 1
        and logits.shape[-1] > 0
        and isinstance(index, torch.Tensor)
        and not index.dtype.is_floating_point
        and index.shape == logits.shape[:-1]
        and float(temperature) >= _MIN_TEMPERATURE
        and (row_mask is None or (isinstance(row_mask, torch.Tensor) and row_mask.shape == index.shape))
    )


def _labels(index: torch.Tensor, row_mask) -> torch.Tensor:
    """TRL's skipped rows (``row_mask == 0``) as ignored labels; no other label is ignored."""
    index = index.long()
    return index if row_mask is None else torch.where(row_mask == 0, _NO_IGNORE, index)


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0,
                          row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """TRL's ``selective_log_softmax`` on ``pf.token_logprobs`` (temperature folded into the
    softmax in float32; rows with ``row_mask == 0`` give 0).  A ``(..., K)`` index (K
    log-probs per row) runs TRL's own function."""
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    if not _ours_can(logits, index, temperature, row_mask):
        return _fallback("selective_log_softmax", logits, index, temperature=temperature, row_mask=row_mask)
    _count("selective_log_softmax")
    with _backend(logits):
        logp = pf.token_logprobs(logits, _labels(index, row_mask), temperature=float(temperature), ignore_index=_NO_IGNORE)
    return logp.to(_trl_dtype(logits, index, row_mask))


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    """TRL's ``entropy_from_logits`` on ``pf.token_logprobs(..., return_entropy=True)``
    (``chunk_size`` is not needed: no ``[N, V]`` intermediate)."""
    if not isinstance(logits, torch.Tensor) or logits.dtype not in _LOGIT_DTYPES or logits.dim() < 1 or logits.shape[-1] == 0:
        return _fallback("entropy_from_logits", logits, chunk_size)
    _count("entropy_from_logits")
    labels = torch.zeros((), dtype=torch.long, device=logits.device).expand(logits.shape[:-1])
    with _backend(logits):
        _, entropy = pf.token_logprobs(logits, labels, return_entropy=True)
    return entropy.to(_trl_dtype(logits))


def selective_log_softmax_and_entropy(logits: torch.Tensor, index: torch.Tensor, entropy_requires_grad: bool = True,
                                      temperature: float = 1.0, row_mask: torch.Tensor | None = None):
    """TRL's ``selective_log_softmax_and_entropy``: both from one ``pf.token_logprobs`` call."""
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    if not _ours_can(logits, index, temperature, row_mask):
        return _fallback("selective_log_softmax_and_entropy", logits, index, entropy_requires_grad=entropy_requires_grad,
                         temperature=temperature, row_mask=row_mask)
    _count("selective_log_softmax_and_entropy")
    with _backend(logits):
        logp, entropy = pf.token_logprobs(logits, _labels(index, row_mask), temperature=float(temperature),
                                          return_entropy=True, ignore_index=_NO_IGNORE)
    dtype = _trl_dtype(logits, index, row_mask)
    entropy = entropy.to(dtype)
    return logp.to(dtype), entropy if entropy_requires_grad else entropy.detach()


# --------------------------------------------------------------------------- fused LM head


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def _transform(z: torch.Tensor, logit_scale: float, softcap) -> torch.Tensor:
    """TRL's logit transform before the temperature: scale, then soft-cap (float32 when either applies)."""
    if logit_scale == 1.0 and softcap is None:
        return z
    z = z.float() * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z


def _row_chunks(n: int, vocab: int):
    rows = max(1, min(n, LM_HEAD_CHUNK_ELEMENTS // max(vocab, 1)))
    return [(start, min(start + rows, n)) for start in range(0, n, rows)]


class _LMHeadLogProbs(torch.autograd.Function):
    """Log-probs (and entropy) of ``hidden @ weight.T + bias`` through ``pf.token_logprobs``,
    one row chunk of logits at a time; the backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, softcap, logit_scale, want_entropy, stats):
        ctx.set_materialize_grads(False)
        cd = _compute_dtype(hidden)
        n = hidden.shape[0]
        logp = torch.empty(n, device=hidden.device, dtype=torch.float32)
        entropy = torch.empty(n, device=hidden.device, dtype=torch.float32) if want_entropy else None
        extra = {name: torch.empty(n, device=hidden.device, dtype=torch.bool if name == "is_top1" else torch.float32)
                 for name in stats}
        w = weight.to(cd)
        b = bias.to(cd) if bias is not None else None
        with torch.autocast(hidden.device.type, enabled=False), _backend(hidden):
            for start, end in _row_chunks(n, weight.shape[0]):
                z = _transform(torch.nn.functional.linear(hidden[start:end].to(cd), w, b), logit_scale, softcap)
                out = pf.token_logprobs(z, targets[start:end], temperature=temperature, return_entropy=want_entropy,
                                        ignore_index=_NO_IGNORE)
                if want_entropy:
                    logp[start:end], entropy[start:end] = out
                else:
                    logp[start:end] = out
                if stats:  # TRL's extra statistics of the temperature-scaled logits (no gradient)
                    zt = z.float() / temperature
                    if "mean_logits" in extra:
                        extra["mean_logits"][start:end] = zt.mean(-1)
                    if "log_sum_sq_probs" in extra:
                        extra["log_sum_sq_probs"][start:end] = torch.logsumexp(2 * zt, -1) - 2 * torch.logsumexp(zt, -1)
                    if "is_top1" in extra:  # the first maximum, as TRL's argmax
                        extra["is_top1"][start:end] = zt.argmax(-1) == targets[start:end]
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.settings = (cd, temperature, softcap, logit_scale, want_entropy)
        ctx.mark_non_differentiable(*extra.values())
        return logp, entropy, extra.get("log_sum_sq_probs"), extra.get("mean_logits"), extra.get("is_top1")

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, *_):
        hidden, weight, bias, targets = ctx.saved_tensors
        cd, temperature, softcap, logit_scale, want_entropy = ctx.settings
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32) if need_h else None
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros(bias.shape, device=bias.device, dtype=torch.float32) if need_b else None
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None, None, None, None
        w = weight.to(cd)
        b = bias.to(cd) if bias is not None else None
        with torch.autocast(hidden.device.type, enabled=False), _backend(hidden):
            for start, end in _row_chunks(hidden.shape[0], weight.shape[0]):
                h = hidden[start:end].to(cd)
                raw = torch.nn.functional.linear(h, w, b).detach().requires_grad_(True)
                with torch.enable_grad():
                    z = _transform(raw, logit_scale, softcap)
                    out = pf.token_logprobs(z, targets[start:end], temperature=temperature, return_entropy=want_entropy,
                                            ignore_index=_NO_IGNORE)
                    outs, grads = [], []
                    lp, ent = out if want_entropy else (out, None)
                    if grad_logp is not None:
                        outs.append(lp)
                        grads.append(grad_logp[start:end].float())
                    if ent is not None and grad_entropy is not None:
                        outs.append(ent)
                        grads.append(grad_entropy[start:end].float())
                    (dz,) = torch.autograd.grad(outs, [raw], grads)
                dz32 = dz.float()
                if grad_h is not None:
                    grad_h[start:end] = dz32 @ w.float()
                if grad_w is not None:
                    grad_w.addmm_(dz32.t(), h.float())
                if grad_b is not None:
                    grad_b += dz32.sum(0)
        return (
            grad_h.to(hidden.dtype) if grad_h is not None else None,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None else None,
            None, None, None, None, None, None,
        )


class ChunkedLogProbFunction:
    """Stands in for TRL's ``ChunkedLogProbFunction`` (``.apply`` with its signature):
    log-probs and entropy on ppo_fast, TRL's three gradient-free statistics from the same logits."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None, logit_scale=1.0,
              outputs=("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")):
        original = _ORIG.get("_ChunkedLogProbFunction")
        if original is None:
            from trl.kernels import ChunkedLogProbFunction as original
        if any(name not in _OUR_OUTPUTS for name in outputs) or float(temperature) < _MIN_TEMPERATURE or hidden.dim() != 2:
            _patching.count(f"{PEER}.fused_lm_head:fallback")
            return original.apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping,
                                  logit_scale, outputs)
        _count("fused_lm_head")
        stats = tuple(name for name in _STATS if name in outputs)
        return _LMHeadLogProbs.apply(hidden, weight, bias, targets.long(), float(temperature), final_logit_softcapping,
                                     float(logit_scale), "entropy" in outputs, stats)


# --------------------------------------------------------------------------- patching

_FUNCTIONS = ("selective_log_softmax", "entropy_from_logits", "selective_log_softmax_and_entropy")

#: What ``patch()`` replaces (for documentation and tests).
REPLACED = {"trl.trainer.utils": _FUNCTIONS + ("_ChunkedLogProbFunction",)}


def _targets() -> list[Target]:
    utils = _utils()
    targets = []
    for name in _FUNCTIONS:
        _ORIG[name] = getattr(utils, name)
        targets.append(Target(utils, name, globals()[name]))
    if hasattr(utils, "_ChunkedLogProbFunction"):
        _ORIG["_ChunkedLogProbFunction"] = utils._ChunkedLogProbFunction
        targets.append(Target(utils, "_ChunkedLogProbFunction", ChunkedLogProbFunction))
    return targets


def patch(backend: str = "auto") -> PatchHandle:
    """Replace TRL's log-prob functions (and its fused LM head's) by ppo_fast's, in place.

    Returns a handle (a context manager).  ``backend`` as in :func:`ppo_fast.integrations.verl.patch`.
    Patching twice is harmless; a TRL other than 1.x raises :class:`UnsupportedPeerVersion`.
    """
    version = _patching.check_version(PEER, DISTRIBUTION, SUPPORTED_VERSIONS)
    return _patching.install(PEER, "trl", backend, version, _targets)


def unpatch() -> None:
    """Restore TRL's originals (whatever handles are still open)."""
    _patching.restore_all(PEER)


def is_patched() -> bool:
    return _patching.is_patched(PEER)


UnsupportedPeerVersion = _patching.UnsupportedPeerVersion
