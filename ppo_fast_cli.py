"""The ``ppo-fast`` command's launcher: parses the command line without importing torch.

Importing anything inside the ``ppo_fast`` package runs ``ppo_fast/__init__.py``, which
imports torch and loads every backend (seconds).  This top-level module reads the
options from ``ppo_fast/trainer/config.py`` and ``command_line.py`` (standard library only) on their own, so
``ppo-fast --help``, ``ppo-fast train --help``, ``ppo-fast options``, a mistyped
flag, a bad option value and a ``train`` into an ``--output-dir`` that already holds a
run (without ``--resume`` or ``--overwrite``; ``ppo_fast/trainer/run_folder.py``, loaded
alone too), a prompts file that cannot be read (``prompts.py``) and a local model
folder without its config or tokenizer (``model_folder.py``), a ``--reward-fn`` whose file,
module or function is not there (``reward_source.py``), ``--device cuda`` where no GPU can be
visible and a ``--resume`` of a run that already did its ``--steps`` answer at once; only a command that runs imports the package
(``ppo_fast.cli.run``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

_CONFIG_MODULE = "_ppo_fast_trainer_config"
_COMMAND_LINE_MODULE = "_ppo_fast_trainer_command_line"
_RUN_FOLDER_MODULE = "_ppo_fast_trainer_run_folder"
_PROMPTS_MODULE = "_ppo_fast_trainer_prompts"
_MODEL_FOLDER_MODULE = "_ppo_fast_trainer_model_folder"
_REWARD_SOURCE_MODULE = "_ppo_fast_trainer_reward_source"


def _trainer_module(name: str, alias: str):
    """``ppo_fast.trainer.<name>`` if already imported, else the same file loaded alone (it
    imports only the standard library)."""
    loaded = sys.modules.get(f"ppo_fast.trainer.{name}") or sys.modules.get(alias)
    if loaded is not None:
        return loaded
    spec = importlib.util.find_spec("ppo_fast")  # a top-level name: finds, does not import
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("ppo-fast: error: the ppo_fast package is not installed in this Python")
    path = Path(list(spec.submodule_search_locations)[0]) / "trainer" / f"{name}.py"
    module_spec = importlib.util.spec_from_file_location(alias, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[alias] = module  # the dataclass and its type hints look it up
    module_spec.loader.exec_module(module)
    return module


def _config_module():
    return _trainer_module("config", _CONFIG_MODULE)


def _command_line():
    """``ppo_fast.trainer.command_line`` (argparse over the config's fields), loaded alone after the config."""
    _config_module()
    return _trainer_module("command_line", _COMMAND_LINE_MODULE)


def _refused(config, args) -> str | None:
    """Why ``train`` cannot start (a bad option value or config file, an --output-dir that
    holds a run), found without torch; ``ppo_fast.cli.run`` checks the same again."""
    try:
        cfg = _command_line().config_from_args(args)
    except config.ConfigError as err:
        return str(err)
    run_folder = _trainer_module("run_folder", _RUN_FOLDER_MODULE)
    if run_folder.elastic_restart(cfg.output_dir):  # the trainer decides (it continues only this job's own run)
        return _input_problem(config, cfg)
    refused = run_folder.refusal(cfg.output_dir, resume=cfg.resume, overwrite=cfg.overwrite)
    if not refused and cfg.resume:
        model_folder = _trainer_module("model_folder", _MODEL_FOLDER_MODULE)
        refused = run_folder.base_problem(cfg.output_dir, cfg.model_name_or_path, model_folder.fingerprint)
    return refused or _input_problem(config, cfg)


def _saved_problem(config, args) -> str | None:
    """What ``eval`` / ``generate`` refuse that needs no torch: a PATH that is not there, ``--best``
    where the run kept no ``best/``, ``generate`` without a prompt, a prompts file that cannot be
    read, a reward function that is not there (``ppo_fast.trainer.saved`` checks the rest)."""
    path = Path(args.path)
    if not path.exists():
        return f"{args.path}: no such file or directory"
    run_folder = _trainer_module("run_folder", _RUN_FOLDER_MODULE)
    marks = ("config.json", "adapter_config.json", "policy")  # a policy folder, or a checkpoint's
    if args.best and not any((path / mark).exists() for mark in marks) and not (path / run_folder.BEST_DIR).is_dir():
        return f"{args.path}: no {run_folder.BEST_DIR}/ (the run was not made with --keep-best)"
    if args.command == "generate" and not (args.prompt or args.prompts_file):
        return "generate: give --prompt TEXT (one or more) or --prompts-file FILE"
    option = "--prompts-file" if args.command == "generate" else "--eval-prompts-file"
    prompts_file = args.prompts_file if args.command == "generate" else args.eval_prompts_file
    if prompts_file is not None:
        try:
            _trainer_module("prompts", _PROMPTS_MODULE).read_prompts(prompts_file, option, load=False)
        except config.ConfigError as err:
            return str(err)
    specs = (getattr(args, "reward_fn", None) or "").split(",")
    return _reward_problem([spec.strip() for spec in specs if spec.strip()])


def _input_problem(config, cfg) -> str | None:
    """A prompts file that cannot be read, a local model folder that cannot be loaded, a reward
    function that is not there, a GPU asked for where none can be visible."""
    device = _command_line().device_problem(cfg.device)
    if device:
        return device
    if cfg.lora_r is not None and importlib.util.find_spec("peft") is None:
        return "--lora-r: PEFT is not installed; pip install peft"
    prompts = _trainer_module("prompts", _PROMPTS_MODULE)
    columns = prompts.Columns(cfg.prompt_column, cfg.answer_column)
    for option in ("prompts_file", "eval_prompts_file"):
        if getattr(cfg, option) is not None:
            try:
                prompts.read_prompts(getattr(cfg, option), config.flag(option), columns, load=False)
            except config.ConfigError as err:
                return str(err)
    if cfg.chat_template is not None and not Path(cfg.chat_template).is_file():
        return f"--chat-template {cfg.chat_template}: no such file"
    model_folder = _trainer_module("model_folder", _MODEL_FOLDER_MODULE)
    for option in ("model_name_or_path", "reward_model"):
        name = getattr(cfg, option)
        refused = name is not None and model_folder.problem(config.flag(option), name)
        if refused:
            return refused
    return _reward_problem(cfg.reward_fns())


def _reward_problem(specs: list[str]) -> str | None:
    """The first ``--reward-fn`` function that is not there, or not callable as a reward function."""
    reward_source = _trainer_module("reward_source", _REWARD_SOURCE_MODULE)
    return next(filter(None, map(reward_source.problem, specs)), None)


def _nothing_to_do(config, args) -> str | None:
    """``--resume`` of a run that finished its ``--steps``: what the trainer would say, without torch."""
    cfg = _command_line().config_from_args(args)
    run_folder = _trainer_module("run_folder", _RUN_FOLDER_MODULE)
    done = run_folder.finished_steps(cfg.output_dir) if cfg.resume else None
    if done is None or done < cfg.steps or run_folder.elastic_restart(cfg.output_dir):
        return None
    return run_folder.nothing_to_do(cfg.output_dir, done, cfg.steps)


def main(argv: list[str] | None = None) -> int:
    """The command; a reader that closes the pipe early (``ppo-fast options --markdown | head``)
    ends it quietly with 141, as a shell reports a process that SIGPIPE stopped."""
    try:
        status = _main(argv)
        sys.stdout.flush()  # what is still buffered fails here, inside the handler
        return status
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that flush is silent.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _main(argv: list[str] | None) -> int:
    config = _config_module()
    parser, train_parser = _command_line().build_parser()
    args = parser.parse_args(argv)
    if args.command == "options":
        print(_command_line().options_markdown() if args.markdown else train_parser.format_help())
        return 0
    if args.command in ("eval", "generate"):
        refused = _saved_problem(config, args)
        if refused:
            print(f"ppo-fast: error: {refused}", file=sys.stderr)
            return 1
        from ppo_fast.cli import run

        return run(args)
    refused = _refused(config, args)
    if refused:
        print(f"ppo-fast: error: {refused}", file=sys.stderr)
        return 1
    done = _nothing_to_do(config, args)
    if done:
        print(done)
        return 0
    from ppo_fast.cli import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
