"""Checks of the code's shape that no linter makes (CI; exit 1 on a finding):

* no function over 80 lines in ppo_fast/ or bench/, except Triton kernels (``@triton.jit``);
* no function with more than 6 positional parameters in the tree (ppo_fast/, bench/, tools/,
  tests/: pass objects, or make the rest keyword-only), except Triton kernels, custom-op schemas
  and their fakes (their signature is the op's), pytest tests (fixtures) and the peers' signatures
  the integrations stand in for (PEER_SIGNATURES); the trainer's loop, trainer.py, at most 400 lines, and every trainer module at most 800;
* at most 10 ``# fmt: skip`` in the tree's Python (ppo_fast/, bench/, tools/, tests/);
* no import cycle among the modules of ppo_fast/ and of bench/, counting every import (a function's
  too), and the layers kept (LAYERS): ppo_fast/spec.py imports nothing from the package, the
  reference backend nothing of the fast backends or their shared loop, the trainer and the
  integrations never the backend registry;
* the contract's names (the agg modes, KL estimators, rollout-correction and policy-loss
  mode names) spelled out as a tuple of strings only in ppo_fast/spec.py.

    python .ci/code_shape.py [ROOT]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_FUNCTION_LINES = 80
MAX_POSITIONAL = 6
TRAINER = Path("ppo_fast") / "trainer"
MAX_LOOP_LINES = 400
MAX_TRAINER_MODULE_LINES = 800  # a room that grows past this is two rooms
MAX_FMT_SKIPS = 10  # hand layouts ruff does not touch: the Triton kernels' long signatures and launches
PACKAGES = ("ppo_fast", "bench")
# Drop-in replacements keep the peer's own signature (positional arguments included).
PEER_SIGNATURES = {
    ("ppo_fast/integrations/verl.py", "agg_loss"),
    ("ppo_fast/integrations/verl.py", "compute_policy_loss_vanilla"),
    ("ppo_fast/integrations/verl.py", "compute_value_loss"),
    ("ppo_fast/integrations/openrlhf.py", "forward"),  # PolicyLoss.forward, ValueLoss.forward
    ("ppo_fast/integrations/trl.py", "apply"),  # ChunkedLogProbFunction.apply
}


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_kernel(node: ast.AST) -> bool:
    return any("jit" in ast.unparse(d) for d in getattr(node, "decorator_list", []))


def long_functions(root: Path, path: Path, tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_kernel(node):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(
                    f"{path.relative_to(root)}:{node.lineno}: {node.name} has {length} lines (> {MAX_FUNCTION_LINES})"
                )
    return found


def op_schemas(tree: ast.AST) -> set[str]:
    """Names of the functions a module hands to torch.library (custom_op, register_fake) or to the native
    backend's ``register(name, fake, ...)``: a custom op's schema or fake kernel."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            called = ast.unparse(node.func)
            if "custom_op" in called or "register_fake" in called or called == "register":
                names |= {a.id for a in node.args if isinstance(a, ast.Name)}
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if any("custom_op" in ast.unparse(d) or "register_fake" in ast.unparse(d) for d in node.decorator_list):
                names.add(node.name)
    return names


def long_argument_lists(root: Path, path: Path, tree: ast.AST) -> list[str]:
    found = []
    relative = path.relative_to(root).as_posix()
    exempt = op_schemas(tree)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if is_kernel(node) or node.name in exempt or (relative, node.name) in PEER_SIGNATURES:
                continue
            if relative.startswith("tests/") and node.name.startswith("test_"):
                continue
            args = node.args.posonlyargs + node.args.args
            count = len([a for a in args if a.arg not in ("self", "cls")])
            if count > MAX_POSITIONAL:
                found.append(
                    f"{path.relative_to(root)}:{node.lineno}: {node.name} takes {count} positional parameters "
                    f"(> {MAX_POSITIONAL}: pass an object, or make them keyword-only)"
                )
    return found


def _import_targets(package: str, node: ast.AST) -> list[str]:
    """The module names one ``import`` or ``from ... import`` statement may load."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def imports_of(name: str, is_package: bool, tree: ast.AST, known: set[str]) -> set[str]:
    """The known modules that module ``name`` imports anywhere: at module level, under ``try``/``if``
    and inside functions (a deferred import is still an arrow between the layers)."""
    package = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {t for t in _import_targets(package, node) if t in known and t != name}
    return out


# Layering: (modules, the modules they may not import, why).  A rule names a module or a package
# (then every module under it).
LAYERS = (
    ("ppo_fast.spec", ("ppo_fast",), "the contract is the bottom layer: torch-free and package-free"),
    (
        "ppo_fast.backends.reference",
        ("ppo_fast.backends.triton", "ppo_fast.backends.native", "ppo_fast.backends._one_pass"),
        "the reference is the oracle of the fast backends: it shares nothing with them",
    ),
    ("ppo_fast.trainer", ("ppo_fast.backends",), "the trainer uses the public API (pf.backend_for), not the registry"),
    (
        "ppo_fast.integrations",
        ("ppo_fast.backends",),
        "the integrations use the public API (pf.backend_for), not the registry",
    ),
)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layering(graph: dict[str, set[str]], rules=LAYERS) -> list[str]:
    """Each import that breaks a rule of ``rules``."""
    found = []
    for module in sorted(graph):
        for lower, banned, why in rules:
            if not _under(module, lower):
                continue
            for target in sorted(graph[module]):
                if any(_under(target, b) for b in banned) and not _under(target, lower):
                    found.append(f"layering: {module} imports {target} ({why})")
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def import_graph(root: Path, trees: dict[Path, ast.AST]) -> dict[str, set[str]]:
    """Each module of ``trees`` (files under ``root``) with the modules among them it imports."""
    known = {module_name(root, f) for f in trees}
    return {
        module_name(root, f): imports_of(module_name(root, f), f.name == "__init__.py", t, known)
        for f, t in trees.items()
    }


def import_problems(graph: dict[str, set[str]]) -> list[str]:
    """The import cycles and the layering rules broken in ``graph``."""
    # A package importing its own submodules is not a cycle with them (they import their siblings).
    found = cycles({m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()})
    return ["import cycle: " + " -> ".join(cycle) for cycle in found] + layering(graph)


def contract_copies(root: Path, path: Path, tree: ast.AST, names: set[str]) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 3:
            values = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            if len(values) >= 3 and values <= names:
                found.append(
                    f"{path.relative_to(root)}:{node.lineno}: a copy of the contract's names {sorted(values)[:4]}..."
                )
    return found


def contract_names(root: Path) -> set[str]:
    tree = ast.parse((root / "ppo_fast" / "spec.py").read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
            target = ast.unparse(node.targets[0])
            if target in ("KL_ESTIMATORS", "AGG_MODES", "ROLLOUT_CORRECTION_MODES"):
                names |= {e.value for e in node.value.elts}
    sys.path.insert(0, str(root))
    return names


def main(root: Path) -> int:
    problems = []
    names = contract_names(root)
    for package in PACKAGES:
        files = sorted((root / package).rglob("*.py"))
        trees = {f: ast.parse(f.read_text(), str(f)) for f in files}
        problems += import_problems(import_graph(root, trees))
        for f, t in trees.items():
            problems += long_functions(root, f, t)
            problems += long_argument_lists(root, f, t)
            if f.name != "spec.py":
                problems += contract_copies(root, f, t, names)
    for room in sorted((root / TRAINER).glob("*.py")):
        lines = len(room.read_text().splitlines())
        if lines > MAX_TRAINER_MODULE_LINES:
            problems.append(
                f"{room.relative_to(root)} has {lines} lines (> {MAX_TRAINER_MODULE_LINES}): split the room"
            )
    loop = root / TRAINER / "trainer.py"
    lines = len(loop.read_text().splitlines())
    if lines > MAX_LOOP_LINES:
        problems.append(f"{loop.relative_to(root)} has {lines} lines (> {MAX_LOOP_LINES}): give a room its own module")
    for folder in ("tools", "tests"):
        for f in sorted((root / folder).rglob("*.py")):
            problems += long_argument_lists(root, f, ast.parse(f.read_text(), str(f)))
    skips = [
        f"{f.relative_to(root)}:{n}"
        for folder in (*PACKAGES, "tools", "tests")
        for f in sorted((root / folder).rglob("*.py"))
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if line.rstrip().endswith("# fmt: skip")
    ]
    if len(skips) > MAX_FMT_SKIPS:
        problems.append(f"{len(skips)} '# fmt: skip' (> {MAX_FMT_SKIPS}): {', '.join(skips[:12])}")
    for p in problems:
        print(p)
    print(f"code shape: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])))
