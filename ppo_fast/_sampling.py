"""The sampling truncations a rollout engine applies before it draws a token, as arguments.

A log-prob "under the sampling distribution" is the label's log-probability after the
engine's processing: the logits divided by the temperature, then the truncations below,
then the softmax renormalised over the kept tokens.  The rule, with ``z`` the scaled logits
of one row and ``w_u = exp(z_u - max z)``:

1. ``min_p``: keep ``u`` where ``w_u >= min_p`` (its probability is at least ``min_p``
   times the largest one's).
2. ``top_k``: keep ``u`` where fewer than ``top_k`` tokens have a strictly larger logit
   (so all tokens tied with the k-th largest are kept).
3. ``top_p``: among the tokens kept so far, ``S``, keep ``u`` where the mass of the tokens of
   ``S`` with a strictly larger logit is below ``top_p * sum(w over S)``: the smallest set of
   largest tokens whose mass reaches ``top_p``, with every token tied at its edge.

This is vLLM's order (min-p, then top-k, then top-p over what min-p left).  Hugging Face
``generate`` applies min-p last; the two agree whenever ``min_p == 0`` or ``top_p == 1``.  Both
engines break a tie at the top-p edge by their sort's order; here every tied token is kept,
so one rule gives one answer on every backend.  A token whose mass lies within float
rounding of the top-p edge may be kept by one engine and not another.

Each kept set is "every logit >= a threshold", and it always holds the largest logit, so it
is never empty.  A row with a NaN or +inf scaled logit (x / T overflows) is not truncated (its result is NaN as
without truncation).  A label outside the kept set could not have been sampled: its
log-prob is ``-inf`` (its ratio to any finite old log-prob is 0).
"""

from __future__ import annotations

from typing import NamedTuple

from . import _validation as check


class Truncation(NamedTuple):
    """``top_k`` (0: off), ``top_p`` (1.0: off), ``min_p`` (0.0: off)."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


NO_TRUNCATION = Truncation()


def truncation(top_k, top_p, min_p, vocab: int) -> Truncation:
    """The checked truncation arguments for a vocabulary of ``vocab`` tokens.  ``top_k`` is an
    int >= 0 or -1 (vLLM's "off"); a ``top_k`` of at least V keeps every token, so it is off
    too; ``top_p`` lies in (0, 1]; ``min_p`` in [0, 1]."""
    top_k = check.integer("top_k", top_k, low=-1)
    top_p = check.real("top_p", top_p, low=0.0, low_open=True, high=1.0)
    min_p = check.real("min_p", min_p, low=0.0, high=1.0)
    return Truncation(top_k if 0 < top_k < vocab else 0, top_p, min_p)
