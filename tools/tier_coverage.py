"""What the fast tier keeps of the conformance matrix, per op of ``ppo_fast.spec.OPS`` x backend:
its cells against the full tier's, and how many of the dtypes, layouts, poisons and variants (and
pairs of dtype, layout and poison) it covers.  Run from the repository root, in the test venv:

    TRITON_INTERPRET=1 python tools/tier_coverage.py      # a markdown table; exit 1 if a rule lost a cell
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_conformance as matrix  # noqa: E402
import tiers  # noqa: E402

from ppo_fast.spec import OPS  # noqa: E402


def main() -> int:
    groups: dict[tuple, dict[str, list]] = {}
    for param in matrix._matrix():
        op, backend, device = param.values[:3]
        group = groups.setdefault((op, backend, device), {"fast": [], "full": []})
        group["full" if tiers.is_full(param) else "fast"].append(param.values[3:])
    print("| op | backend | device | fast cells | full-tier cells | dtypes | layouts | poisons | variants | pairs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    lost = 0
    for op in OPS:
        for (name, backend, device), group in groups.items():
            if name != op:
                continue
            fast, axes = group["fast"], matrix.axes(op)
            covered = [len({c[i] for c in fast}) for i in range(3)]
            variants = len({repr(c[3]) for c in fast})
            pairs = sum(len({(c[i], c[j]) for c in fast}) for i, j in itertools.combinations(range(3), 2))
            all_pairs = sum(len(axes[i]) * len(axes[j]) for i, j in itertools.combinations(range(3), 2))
            n_variants = len(matrix.VARIANTS[op][2])
            strength = matrix._strength(backend, device)
            lost += covered != [len(a) for a in axes] or variants != n_variants
            lost += strength == 2 and pairs != all_pairs
            print(
                f"| {op} | {backend} | {device} | {len(fast)} | {len(group['full'])} | "
                + " | ".join(f"{n}/{len(a)}" for n, a in zip(covered, axes))
                + f" | {variants}/{n_variants} | {pairs}/{all_pairs}{'' if strength == 2 else ' (values only)'} |"
            )
    uncompared = [op for op in OPS if not any(key[0] == op for key in groups)]
    missing = [op for op in uncompared if any(matrix.fast(op, device) for device in matrix.DEVICES)]
    print(f"\nops served by the reference alone (nothing to compare with it): {', '.join(uncompared) or 'none'}")
    print(f"ops with a fast backend but no cell: {missing or 'none'}; rules that lost a cell: {lost}")
    return 1 if lost or missing else 0


if __name__ == "__main__":
    sys.exit(main())
