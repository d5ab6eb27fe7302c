"""The ``ppo-fast`` command's launcher: parses the command line without importing torch.

Importing anything inside the ``ppo_fast`` package runs ``ppo_fast/__init__.py``, which
imports torch and loads every backend (seconds).  This top-level module reads the
options from ``ppo_fast/trainer/config.py`` (standard library only) on its own, so
``ppo-fast --help``, ``ppo-fast train --help``, ``ppo-fast options`` and a mistyped
flag answer at once; only a command that runs imports the package
(``ppo_fast.cli.run``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_CONFIG_MODULE = "_ppo_fast_trainer_config"


def _config_module():
    """``ppo_fast.trainer.config`` if already imported, else the same file loaded alone."""
    loaded = sys.modules.get("ppo_fast.trainer.config") or sys.modules.get(_CONFIG_MODULE)
    if loaded is not None:
        return loaded
    spec = importlib.util.find_spec("ppo_fast")  # a top-level name: finds, does not import
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("ppo-fast: error: the ppo_fast package is not installed in this Python")
    path = Path(list(spec.submodule_search_locations)[0]) / "trainer" / "config.py"
    config_spec = importlib.util.spec_from_file_location(_CONFIG_MODULE, path)
    module = importlib.util.module_from_spec(config_spec)
    sys.modules[_CONFIG_MODULE] = module  # the dataclass and its type hints look it up
    config_spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    config = _config_module()
    parser, train_parser = config.build_parser()
    args = parser.parse_args(argv)
    if args.command == "options":
        print(config.options_markdown() if args.markdown else train_parser.format_help())
        return 0
    from ppo_fast.cli import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
