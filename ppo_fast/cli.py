"""The ``ppo-fast`` command: ``ppo-fast train [options]``, ``ppo-fast eval|generate PATH`` (a trained
policy, ``ppo_fast.trainer.saved``) and ``ppo-fast options [--markdown]``.

The console script starts in ``ppo_fast_cli`` (top level), which parses the command line
without importing torch and calls :func:`run`; ``python -m ppo_fast`` and tests call
:func:`main`.  A user error (a bad option, a missing file or model, a reward function
that cannot be imported, ...) is reported as one ``ppo-fast: error: ...`` line and exit
status 1 (2 for a bad command line), after its full traceback with ``--debug``; a bug
still shows its traceback.
"""

from __future__ import annotations

import argparse
import errno
import sys
import traceback

# A full disk (or quota) or an output directory that cannot be written: a user's problem, one line.
_DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def main(argv: list[str] | None = None) -> int:
    from .trainer.command_line import build_parser, options_markdown

    parser, train_parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "options":
        print(options_markdown() if args.markdown else train_parser.format_help())
        return 0
    return run(args)


def _fail(message: str) -> int:
    print(f"ppo-fast: error: {message}", file=sys.stderr)
    return 1


def run(args: argparse.Namespace) -> int:
    """Run the parsed ``train``, ``eval`` or ``generate`` command; returns the exit status."""
    from .trainer.command_line import config_from_args
    from .trainer.config import ConfigError

    if args.command in ("eval", "generate"):
        from .trainer import saved

        try:
            return saved.run(args)
        except ConfigError as err:
            return _fail(str(err))
    from .trainer.run_folder import elastic_restart, refusal

    try:
        cfg = config_from_args(args)
    except ConfigError as err:
        return _fail(str(err))
    # A folder that holds a run, before the trainer is imported (PPOTrainer checks it again, for every rank).
    refused = (
        None if elastic_restart(cfg.output_dir) else refusal(cfg.output_dir, resume=cfg.resume, overwrite=cfg.overwrite)
    )
    if refused:
        return _fail(refused)

    from . import BackendUnavailableError
    from .trainer import NonFiniteError, PPOTrainer, RewardError
    from .trainer.async_rollouts import ProducerError
    from .trainer.distributed import RankLost, leave_on_error, shutdown

    try:
        summary = PPOTrainer(cfg).train()
    except (ConfigError, RewardError, NonFiniteError, BackendUnavailableError, RankLost, ProducerError) as err:
        if cfg.debug:  # the whole story: a reward function's own traceback is the cause
            traceback.print_exception(err)
        return leave_on_error(_fail(str(err)))
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the PPO loop: stop at once, quietly
        print(f"ppo-fast: stopped; the last complete checkpoint in {cfg.output_dir} is kept", file=sys.stderr)
        return leave_on_error(130)
    except OSError as err:
        if err.errno not in _DISK_ERRORS:
            raise
        message = (
            f"cannot write {err.filename or cfg.output_dir}: {err.strerror}; the last complete checkpoint "
            f"in {cfg.output_dir} is kept (free space, or choose another --output-dir, and --resume)"
        )
        return leave_on_error(_fail(message))
    finally:
        shutdown()
    # 130: the conventional exit status after Ctrl-C.
    return 0 if summary["stop_reason"] == "done" else 130


if __name__ == "__main__":
    sys.exit(main())
