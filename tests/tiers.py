"""The two tiers of the suite (docs/testing.md): the fast tier (the default) runs every rule on every
op x backend at least once; the full tier (``--full``) adds the rest of each cross-product.  A
cross-product is sampled by a covering: the cases in which every value of each axis (strength 1),
or every pair of values of two axes (strength 2), occurs at least once.  The cases left out are
marked ``full`` (tests/conftest.py deselects them unless asked for)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import pytest

FULL = pytest.mark.full


def covering(rows: Sequence[tuple], strength: int = 2, cost: Callable[[tuple], float] | None = None) -> set[int]:
    """Indices of rows (one value per axis) in which every combination of ``strength`` axes' values
    that occurs in ``rows`` occurs too.  Greedy: the first row, then the row that covers the most
    combinations not yet covered, the cheaper one (``cost``) first among equals."""

    def combos(row: tuple) -> set:
        return {(axes, tuple(repr(row[a]) for a in axes)) for axes in itertools.combinations(range(len(row)), strength)}

    if not rows:
        return set()
    each = [combos(row) for row in rows]  # once: collection pays for every greedy step otherwise
    wanted = set().union(*each)
    kept, covered = {0}, set(each[0])
    gain = lambda i: (len(each[i] - covered), -(cost(rows[i]) if cost else 0), -i)  # noqa: E731
    while covered != wanted:
        best = max((i for i in range(len(rows)) if i not in kept), key=gain)
        kept.add(best)
        covered |= each[best]
    return kept


def sampled(params: Sequence, strength: int = 2, cost: Callable[[tuple], float] | None = None) -> list:
    """``params`` (``pytest.param`` or tuples of values), those outside a covering marked ``full``."""
    params = [p if hasattr(p, "values") else pytest.param(*p) for p in params]
    kept = covering([p.values for p in params], strength, cost)
    return [case(*p.values, fast=i in kept, id=p.id, marks=p.marks) for i, p in enumerate(params)]


def case(*values, fast: bool, id: str, marks=()):
    """One ``pytest.param``: in the fast tier when ``fast``, else marked ``full``."""
    return pytest.param(*values, marks=[*marks] if fast else [*marks, FULL], id=id)


def is_full(param) -> bool:
    return any(mark.name == "full" for mark in param.marks)
