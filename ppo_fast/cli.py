"""The ``ppo-fast`` command: ``ppo-fast train [options]`` and ``ppo-fast options [--markdown]``."""

from __future__ import annotations

import argparse
import sys


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """(the top-level parser, the ``train`` sub-command's parser)."""
    from .trainer.config import add_arguments

    parser = argparse.ArgumentParser(prog="ppo-fast", description="Kernel-accelerated PPO for language models.")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train", help="run PPO (with no options: the built-in offline addition task)",
        description="Run PPO. With no options, trains the built-in addition task offline (CPU or GPU).",
    )
    train.add_argument("--config", metavar="FILE", help="YAML or JSON file of options; flags given here override it")
    add_arguments(train)
    options = commands.add_parser("options", help="list the training options")
    options.add_argument("--markdown", action="store_true", help="as a Markdown table (for the README)")
    return parser, train


def main(argv: list[str] | None = None) -> int:
    parser, train_parser = _parsers()
    args = parser.parse_args(argv)
    from .trainer.config import config_from_args, options_markdown

    if args.command == "options":
        print(options_markdown() if args.markdown else train_parser.format_help())
        return 0

    from .trainer import NonFiniteError, PPOTrainer, RewardError

    try:
        summary = PPOTrainer(config_from_args(args)).train()
    except (ValueError, RewardError, NonFiniteError, FileNotFoundError) as err:
        print(f"ppo-fast: error: {err}", file=sys.stderr)
        return 1
    # 130: the conventional exit status after Ctrl-C.
    return 0 if summary["stop_reason"] == "done" else 130


if __name__ == "__main__":
    sys.exit(main())
