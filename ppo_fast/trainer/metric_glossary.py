"""Every metric a run writes (``metrics.jsonl``, the trackers), with its meaning: the ``METRICS`` of the
modules that compute them, gathered here.  ``docs/metrics.md`` is generated from it
(``tools/docs_pages.py``), and a test checks that a run writes no metric it does not explain."""

from __future__ import annotations

import re

from . import async_rollouts, evaluation, metrics, off_policy, partial_rollouts, scoring, update

# The modules that compute metrics, in the order of the glossary.
SOURCES = (metrics, update, scoring, off_policy, async_rollouts, partial_rollouts, evaluation)


def glossary() -> dict[str, tuple[str, str]]:
    """``{name: (meaning, module)}``; a ``<placeholder>`` in a name stands for any one path segment."""
    return {name: (meaning, module.__name__) for module in SOURCES for name, meaning in module.METRICS.items()}


def undocumented(names) -> list[str]:
    """The names among ``names`` that no glossary entry explains."""
    patterns = [re.compile(re.sub(r"<[a-z_]+>", "[^/]+", re.escape(name))) for name in glossary()]
    return sorted(name for name in names if not any(p.fullmatch(name) for p in patterns))


def markdown() -> str:
    lines = ["| metric | meaning | computed in |", "|---|---|---|"]
    for name, (meaning, module) in glossary().items():
        lines.append(f"| `{name}` | {meaning} | `{module.removeprefix('ppo_fast.trainer.')}` |")
    return "\n".join(lines)
