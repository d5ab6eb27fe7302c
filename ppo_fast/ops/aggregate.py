"""Public ops: masked statistics, whitening and verl's loss aggregation modes."""

from __future__ import annotations

import torch

from .. import _validation as check
from .._varlen import one_row, varlen
from ..backends import reference
from ..spec import AGG_MODES

__all__ = ["aggregate", "masked_mean", "masked_whiten"]


def _aggregate_packed(segments, per_token, mask, agg="token-mean"):
    check.tensor("per_token", per_token, ndim=1)
    check.same_device(per_token=per_token, mask=mask)
    mask = check.mask("mask", mask, per_token.shape)
    check.choice("agg", agg, AGG_MODES)
    return reference.aggregate_packed(segments, per_token, mask, agg)


def _masked_mean_packed(segments, x, mask, dim=None):
    if dim is not None:
        raise ValueError(
            f"masked_mean: dim must be None with cu_seqlens (the packed x has no rows to reduce over), got {dim!r}"
        )
    return masked_mean(x[None], mask[None])


def _masked_whiten_packed(segments, x, mask, **kwargs):
    return one_row(masked_whiten(x[None], mask[None], **kwargs))


@varlen("per_token", "mask", packed=_aggregate_packed)
def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean"):
    """Reduce a ``[B, T]`` per-token loss over ``mask`` as verl's ``agg_loss`` does.

    ``agg``: ``token-mean`` (mean over all valid tokens), ``token-sum``, ``seq-mean-token-sum``
    (mean over rows of each row's sum), ``seq-mean-token-mean`` (mean over rows with a valid
    token of each row's mean), ``seq-mean-token-sum-norm`` (the row sums' total over T).  An
    empty selection gives 0.  Differentiable w.r.t. ``per_token``; float32 (float64 for float64 input).
    """
    check.tensor("per_token", per_token, ndim=2)
    check.same_device(per_token=per_token, mask=mask)
    mask = check.mask("mask", mask, per_token.shape)
    check.choice("agg", agg, AGG_MODES)
    return reference.aggregate(per_token, mask, agg)


@varlen("x", "mask", packed=_masked_mean_packed)
def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None):
    """Mean of ``x`` over the entries where ``mask`` is 1/True (over ``dim`` if given); 0 if none.

    With ``cu_seqlens`` the mean is over every valid packed token and ``dim`` must be None (a
    named error otherwise): the packed ``[N]`` tokens have no row dimension to reduce over."""
    check.tensor("x", x)
    check.same_device(x=x, mask=mask)
    mask = check.mask("mask", mask, x.shape)
    if dim is not None:
        dims = dim if isinstance(dim, tuple) else (dim,)
        if not isinstance(dim, (int, tuple)) or any(isinstance(d, bool) or not isinstance(d, int) for d in dims):
            raise TypeError(f"dim must be None, an int or a tuple of ints, got {dim!r}")
        for d in dims:
            if not -x.dim() <= d < max(x.dim(), 1):
                raise ValueError(
                    f"dim must lie in [{-x.dim()}, {x.dim() - 1}] for x of shape {tuple(x.shape)}, got {d}"
                )
    return reference.masked_mean(x, mask, dim)


@varlen("x", "mask", packed=_masked_whiten_packed)
def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8):
    """Normalise ``x`` to zero mean and unit variance over the valid entries.

    The variance is Bessel-corrected; with ``shift_mean=False`` the mean is added
    back after scaling (both as in TRL and verl).  Masked entries are 0 in the output.  A mask
    with no valid entry raises ``ValueError`` on CPU in eager mode (a batch of padding has
    nothing to whiten); on CUDA and under torch.compile, where checking would cost a host
    sync, it gives all zeros.
    """
    check.tensor("x", x)
    check.same_device(x=x, mask=mask)
    mask = check.mask("mask", mask, x.shape)
    eps = check.real("eps", eps, low=0.0)
    check.flag("shift_mean", shift_mean)
    if check.host_checks_free(mask) and not bool(mask.any()):
        raise ValueError("mask has no valid entry: nothing to whiten")
    return reference.masked_whiten(x, mask, shift_mean, eps)
