"""Public ops: GAE, masked statistics and whitening."""

from __future__ import annotations

from .. import _validation as check
from .. import reference
from ..backends import resolve


def gae(rewards, values, mask, *, gamma=1.0, lam=0.95):
    """Generalised advantage estimation over the valid tokens of each row.

    Args:
        rewards, values: ``[B, T]`` per-token rewards and critic values.
        mask: ``[B, T]`` 1/True at valid tokens.  The valid tokens of a row, in
            order, are its episode: a masked token inside a row (e.g. a tool output)
            is skipped, not a terminal; the value after the last valid token is 0.
        gamma: discount in [0, 1].  lam: GAE lambda in [0, 1].

    Returns:
        ``(advantages, returns)`` float32 ``[B, T]`` with
        ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``
        and ``returns = advantages + values``; both 0 at masked positions, where
        rewards and values are ignored.
    """
    check.tensor("rewards", rewards, ndim=2)
    check.tensor("values", values, ndim=2)
    check.same_shape("rewards", rewards, values=values)
    check.same_device(rewards=rewards, values=values, mask=mask)
    mask = check.mask("mask", mask, rewards.shape)
    gamma = check.real("gamma", gamma, low=0.0, high=1.0)
    lam = check.real("lam", lam, low=0.0, high=1.0)
    return resolve("gae", rewards.device.type)(rewards, values, mask, gamma, lam)


def masked_mean(x, mask, dim=None):
    """Mean of ``x`` over the entries where ``mask`` is 1/True (over ``dim`` if given); 0 if none."""
    check.tensor("x", x)
    check.same_device(x=x, mask=mask)
    mask = check.mask("mask", mask, x.shape)
    if dim is not None:
        dims = dim if isinstance(dim, tuple) else (dim,)
        if not isinstance(dim, (int, tuple)) or any(isinstance(d, bool) or not isinstance(d, int) for d in dims):
            raise TypeError(f"dim must be None, an int or a tuple of ints, got {dim!r}")
        for d in dims:
            if not -x.dim() <= d < max(x.dim(), 1):
                raise ValueError(f"dim must lie in [{-x.dim()}, {x.dim() - 1}] for x of shape {tuple(x.shape)}, got {d}")
    return reference.masked_mean(x, mask, dim)


def masked_whiten(x, mask, *, shift_mean=True, eps=1e-8):
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
