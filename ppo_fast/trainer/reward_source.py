"""Where a ``--reward-fn`` lives, checked without importing it.

``module:function`` (a module on the Python path or in the working directory) or
``path/to/file.py:function``.  :func:`problem` finds the file and reads it (without running
it) for the function, so that the ``ppo-fast`` launcher reports a wrong name at once, before
torch loads; ``scoring.load_reward_fn`` then imports it.  Standard library only: the launcher
loads this file on its own.
"""

from __future__ import annotations

import ast
import importlib.machinery
import os
import sys
from pathlib import Path


def split(spec: str) -> tuple[str, str]:
    """``(module or file, function)``; empty strings where ``spec`` has no such part."""
    module, _, function = spec.rpartition(":")
    return module, function


def is_file(module: str) -> bool:
    return module.endswith(".py") or os.sep in module or "/" in module


def problem(spec: str) -> str | None:
    """What is wrong with ``--reward-fn spec`` that shows without running the user's code (the
    error line, without ``ppo-fast: error:``), or None."""
    where = f"--reward-fn {spec}"
    module, function = split(spec)
    if not module or not function:
        return f"{where}: must look like 'module:function' or 'path/to/file.py:function'"
    if is_file(module):
        path = Path(module)
        if not path.is_file():
            return f"{where}: no such file {path}"
    else:
        path = _module_file(module)
        if path is False:
            return no_module(spec)
    if path is None or path.suffix != ".py":
        return None  # a package's submodule or an extension module: seen when imported
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    except SyntaxError as err:
        shown = repr(module) if not is_file(module) else str(path)
        return f"{where}: importing {shown} failed: SyntaxError: {err.msg} ({err.filename}, line {err.lineno})"
    except (OSError, UnicodeDecodeError):
        return None
    names, defined = _top_level_names(tree)
    if names is None or function in names:
        return _signature_problem(where, path, tree, function)
    hint = f" (it defines: {', '.join(sorted(defined))})" if defined else ""
    return f"{where}: {module!r} has no function {function!r}{hint}"


# How the trainer calls a reward function (scoring.FunctionScorer): by keyword, as TRL does, when it
# takes **kwargs or an argument of this name; else positionally, with the answers when it takes a third.
KEYWORD_STYLE_ARGUMENT = "completions"
SIGNATURES = "fn(prompts, responses), fn(prompts, responses, answers) or TRL's fn(prompts, completions, **kwargs)"


def keyword_style(positional: list[str], keyword_only: list[str], var_keyword: bool) -> bool:
    return var_keyword or KEYWORD_STYLE_ARGUMENT in positional + keyword_only


def signature_problem(
    positional: list[str], required: int, keyword_only_required: list[str], var_positional: bool, var_keyword: bool
) -> str | None:
    """Why a function of this signature cannot be called as a reward function, or None.
    ``positional``: its positional parameters' names, the first ``required`` without a default."""
    if keyword_style(positional, keyword_only_required, var_keyword):
        return None  # its other arguments name columns of the prompts' rows: checked when it is called
    if keyword_only_required:
        return f"needs the keyword argument(s) {', '.join(keyword_only_required)}"
    if var_positional:
        return None if required <= 3 else f"needs {required} positional arguments"
    count = min(len(positional), 3)
    if count < 2 or required > count:
        return f"takes {len(positional)} positional argument(s), {required} required"
    return None


def _signature_problem(where: str, path: Path, tree: ast.Module, function: str) -> str | None:
    node = next(
        (n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function), None
    )
    if node is None:  # a class, an alias, an import: its signature is seen when imported
        return None
    args = node.args
    positional = [a.arg for a in args.posonlyargs + args.args]
    required = len(positional) - len(args.defaults)
    keyword_only_required = [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None]
    problem = signature_problem(positional, required, keyword_only_required, bool(args.vararg), bool(args.kwarg))
    if problem is None:
        return None
    return f"{where}: {path}:{node.lineno}: {function}() {problem}; a reward function is called as {SIGNATURES}"


def no_module(spec: str) -> str:
    module, function = split(spec)
    return (
        f"--reward-fn {spec}: no module {module!r} in the working directory ({os.getcwd()}) or on the Python "
        f"path; run from the folder that holds {module.replace('.', '/')}.py, or give its path: "
        f"--reward-fn path/to/{module.rsplit('.', 1)[-1]}.py:{function}"
    )


def _module_file(module: str) -> Path | None | bool:
    """The source of a top-level module on the Python path or in the working directory; False
    when there is none; None when it cannot be told without importing (a dotted name)."""
    if "." in module:
        return None
    spec = importlib.machinery.PathFinder.find_spec(module, [*sys.path, os.getcwd()])
    if spec is None:
        return False if module not in sys.builtin_module_names else None
    return Path(spec.origin) if spec.origin and spec.has_location else None


def _top_level_names(tree: ast.Module) -> tuple[set[str] | None, set[str]]:
    """``(every name the module binds at its top level, or None when it binds names it does not
    spell (a star import, globals()), the public functions and classes it defines)``."""
    names, defined = set(), set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if not node.name.startswith("_"):
                defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(alias.name == "*" for alias in node.names):
                return None, defined
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        else:
            names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    if any(isinstance(n, ast.Name) and n.id in ("globals", "setattr", "exec") for n in ast.walk(tree)):
        return None, defined
    return names, defined
