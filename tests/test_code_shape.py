"""The layering rules of .ci/code_shape.py catch what they name, on a small tree made for each rule
(every import counted, a function's too), and pass a tree that keeps them."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("code_shape", ROOT / ".ci" / "code_shape.py")
code_shape = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(code_shape)

# A tree that keeps every rule: the package's layers as the real one has them.
CLEAN = {
    "ppo_fast/__init__.py": "from . import spec\nfrom .backends import backend_for\n",
    "ppo_fast/spec.py": "import math\n",
    "ppo_fast/_validation.py": "from .spec import x\n",
    "ppo_fast/backends/__init__.py": "from ..spec import OPS\n",
    "ppo_fast/backends/_one_pass.py": "from .reference import _loss_terms\n",
    "ppo_fast/backends/reference/__init__.py": "from .. import collect\n",
    "ppo_fast/backends/reference/_loss_terms.py": "from . import policy_loss\n",
    "ppo_fast/backends/reference/policy_loss.py": "from ...spec import MODES\n",
    "ppo_fast/backends/triton/__init__.py": "from .._one_pass import rows_ops\n",
    "ppo_fast/trainer/__init__.py": "",
    "ppo_fast/trainer/update.py": "import ppo_fast as pf\n\ndef f():\n    return pf.backend_for('op', 'cpu')\n",
}

# One file changed per rule (a function-level import where that is the way it hides), and the finding expected.
BROKEN = {
    "spec imports the package": (
        {"ppo_fast/spec.py": "def check():\n    from . import _validation\n"},
        "layering: ppo_fast.spec imports ppo_fast._validation",
    ),
    "a cycle through a function-level import": (
        {"ppo_fast/spec.py": "def check():\n    from ._validation import real\n"},
        "import cycle: ppo_fast._validation -> ppo_fast.spec -> ppo_fast._validation",
    ),
    "the reference imports the fast loop": (
        {"ppo_fast/backends/reference/policy_loss.py": "from .. import _one_pass\n"},
        "layering: ppo_fast.backends.reference.policy_loss imports ppo_fast.backends._one_pass",
    ),
    "the reference imports a fast backend": (
        {"ppo_fast/backends/reference/policy_loss.py": "def f():\n    import ppo_fast.backends.triton\n"},
        "layering: ppo_fast.backends.reference.policy_loss imports ppo_fast.backends.triton",
    ),
    "the trainer imports the registry": (
        {"ppo_fast/trainer/update.py": "def f():\n    from ppo_fast.backends import resolve\n"},
        "layering: ppo_fast.trainer.update imports ppo_fast.backends",
    ),
}


def _problems(tmp_path: Path, files: dict[str, str]) -> list[str]:
    trees = {}
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        trees[path] = ast.parse(text)
    return code_shape.import_problems(code_shape.import_graph(tmp_path, trees))


def test_a_tree_that_keeps_the_layers_passes(tmp_path):
    assert _problems(tmp_path, CLEAN) == []


@pytest.mark.parametrize("rule", sorted(BROKEN))
def test_each_layering_rule_is_caught(tmp_path, rule):
    change, expected = BROKEN[rule]
    problems = _problems(tmp_path, {**CLEAN, **change})
    assert any(p.startswith(expected) for p in problems), problems
