"""The command line of ``ppo-fast``: one flag per ``TrainerConfig`` field (argparse), the renamed flags'
warnings, the options table, and the checks of the command line that need no torch.

Like ``config.py`` it imports only the standard library: the ``ppo-fast`` launcher
(``ppo_fast_cli.py``) loads it on its own, with ``config.py``, to answer ``--help`` and to parse
the command line without importing torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path


def _config_module():
    """``ppo_fast.trainer.config``, or, when this file is loaded alone (the launcher), the same file
    loaded alone (importing it through the package would import torch)."""
    if __name__.startswith("ppo_fast."):
        return importlib.import_module("ppo_fast.trainer.config")
    alias = "_ppo_fast_trainer_config"
    loaded = sys.modules.get("ppo_fast.trainer.config") or sys.modules.get(alias)
    if loaded is None:
        module_spec = importlib.util.spec_from_file_location(alias, Path(__file__).resolve().with_name("config.py"))
        loaded = importlib.util.module_from_spec(module_spec)
        sys.modules[alias] = loaded  # the dataclass and its type hints look it up
        module_spec.loader.exec_module(loaded)
    return loaded


_CONFIG = _config_module()
ConfigError, TrainerConfig, CHOICES, DEVICES = (
    _CONFIG.ConfigError,
    _CONFIG.TrainerConfig,
    _CONFIG.CHOICES,
    _CONFIG.DEVICES,
)
ALIASES, alias_warning = _CONFIG.ALIASES, _CONFIG.alias_warning
RENAMED, flag, renamed_warning, read_config_file = (
    _CONFIG.RENAMED,
    _CONFIG.flag,
    _CONFIG.renamed_warning,
    _CONFIG.read_config_file,
)
_type_hints, _base_type, _coerce = _CONFIG._type_hints, _CONFIG._base_type, _CONFIG._coerce


def device_problem(device: str) -> str | None:
    """``--device cuda`` on a machine where no GPU can be visible, told without torch: an empty
    ``CUDA_VISIBLE_DEVICES``, or no GPU device file (NVIDIA's, ROCm's, WSL's); None otherwise (torch
    has the last word, once loaded)."""
    if device != "cuda":
        return None
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1")
    devices = Path("/dev")
    present = any(devices.glob("nvidia[0-9]*")) or (devices / "kfd").exists() or (devices / "dxg").exists()
    if hidden or not present:
        why = "CUDA_VISIBLE_DEVICES hides every GPU" if hidden else "no GPU device in /dev"
        return f"--device cuda: no GPU is visible ({why}); use --device cpu (or auto)"
    return None


# ---------------------------------------------------------------------- command line


# A negative number as an option's value (``--learning-rate -1e-4``); argparse's own pattern
# misses exponents and so takes ``-1e-4`` for an option.
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-inf$")


class _Parser(argparse.ArgumentParser):
    """Reports a bad command line as one ``ppo-fast: error: ...`` line (exit status 2); takes
    no abbreviated flags (``--learning-rat`` is an error with a hint, not ``--learning-rate``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_NUMBER

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        command = self.prog.split(" ", 1)
        sub = (
            command[1]
            if len(command) > 1
            else next((a for a in getattr(self, "_argv", []) if a in ("train", "options", "eval", "generate")), "")
        )
        if message.startswith("unrecognized arguments:"):
            guesses = []
            for word in message.split(":", 1)[1].split():
                name = word.split("=")[0]
                close = did_you_mean(name) if name.startswith("--") else None
                if close:
                    guesses.append(f"{name}: did you mean {close}?")
            if guesses:
                message += f" ({'; '.join(guesses)})"
        where = f" {sub}" if sub else ""
        self.exit(2, f"ppo-fast: error: {message}; `ppo-fast{where} --help` lists the options\n")


def did_you_mean(name: str) -> str | None:
    """The flag a mistyped ``name`` most likely meant, by its current name; never one that only adds
    words to ``name`` or drops some (``--cliprange`` is not ``--cliprange-value``: another concept)."""
    fields = [f.name for f in dataclasses.fields(TrainerConfig)]
    current = {flag(n): flag(n) for n in [*fields, "config", "markdown", "help"]}
    current |= {flag(old): flag(new) for old, new in RENAMED.items()} | {flag(alias): flag(alias) for alias in ALIASES}
    words = name.strip("-").split("-")
    for close in difflib.get_close_matches(name, list(current), n=5):
        other = close.strip("-").split("-")
        if set(words) < set(other) or set(other) < set(words):
            continue
        # A typo, or the words run together: the letters agree but for a few.
        if difflib.SequenceMatcher(None, "".join(words), "".join(other)).ratio() >= 0.8:
            return current[close]
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field, grouped, defaulting to None so that only given flags override."""
    hints = _type_hints()
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(TrainerConfig):
        group_name = f.metadata["group"]
        group = groups.setdefault(group_name, parser.add_argument_group(f"{group_name} options"))
        base = _base_type(hints[f.name])
        bounds = f"; {f.metadata['bounds']}" if "bounds" in f.metadata else ""
        help_text = f"{f.metadata['help']} (default: {f.default}{bounds})".replace("%", "%%")
        if base is bool:
            group.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif f.name in CHOICES:
            group.add_argument(flag(f.name), choices=CHOICES[f.name], default=None, help=help_text)
        else:
            group.add_argument(
                flag(f.name), type=_flag_type(base), default=None, metavar=base.__name__.upper(), help=help_text
            )
    for alias in ALIASES:  # other trainers' names, hidden from --help
        parser.add_argument(flag(alias), type=float, action=_Alias, default=None, help=argparse.SUPPRESS)
    for old, new in RENAMED.items():  # the old flags, hidden from --help
        if _base_type(hints[new]) is bool:  # --old and --no-old
            names, kind = (flag(old), "--no-" + flag(old)[2:]), {"nargs": 0}
        else:
            names = (flag(old),)
            kind = {"choices": CHOICES[new]} if new in CHOICES else {"type": _flag_type(_base_type(hints[new]))}
        parser.add_argument(*names, dest=new, action=_Renamed, default=None, help=argparse.SUPPRESS, **kind)


class _Renamed(argparse.Action):
    """A renamed option's old flag: stores under the new name and says so in one line."""

    def __call__(self, parser, namespace, values, option_string=None):
        negated = self.nargs == 0 and option_string.startswith("--no-")
        old = option_string[5 if negated else 2 :].replace("-", "_")
        print(renamed_warning(old), file=sys.stderr)
        setattr(namespace, self.dest, (not negated) if self.nargs == 0 else values)


class _Alias(argparse.Action):
    """Another trainer's flag (``ALIASES``): sets each of our options it stands for, and says so."""

    def __call__(self, parser, namespace, values, option_string=None):
        name = option_string[2:].replace("-", "_")
        print(alias_warning(name), file=sys.stderr)
        for option in ALIASES[name]:
            setattr(namespace, option, values)


def _flag_type(base):
    if base is str:
        return str

    def parse(text: str):
        return _coerce("value", text, base, "flag")

    parse.__name__ = base.__name__  # argparse's message: "invalid int value: 'three'"
    return parse


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """(the ``ppo-fast`` parser, its ``train`` sub-command's parser)."""
    parser = _Parser(prog="ppo-fast", description="Kernel-accelerated PPO for language models.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser(
        "train",
        help="run PPO (with no options: the built-in offline addition task)",
        description="Run PPO. With no options, trains the built-in addition task offline (CPU or GPU).",
    )
    train.add_argument("--config", metavar="FILE", help="YAML or JSON file of options; flags given here override it")
    add_arguments(train)
    options = commands.add_parser("options", help="list the training options")
    options.add_argument("--markdown", action="store_true", help="as a Markdown table (for the README)")
    _add_saved_commands(commands)
    return parser, train


def _add_saved_commands(commands) -> None:
    """``eval`` and ``generate``: a trained policy after the run (ppo_fast.trainer.saved)."""
    where = (
        "a run folder (its latest checkpoint's policy), a checkpoint (checkpoints/step-N) or a policy folder "
        "(save_pretrained's)"
    )
    evaluate = commands.add_parser(
        "eval",
        help="score a trained policy's greedy responses on held-out prompts",
        description="Score a trained policy's greedy responses to held-out prompts with the run's reward "
        "(the run's own held-out prompts and reward unless given); prints one JSON line.",
    )
    sample = commands.add_parser(
        "generate",
        help="sample responses from a trained policy",
        description="Responses of a trained policy (greedy unless --temperature); one JSON line per prompt.",
    )
    for command in (evaluate, sample):
        command.add_argument("path", metavar="PATH", help=where)
        command.add_argument("--best", action="store_true", help="the run folder's best/ (--keep-best) policy")
        command.add_argument("--device", default="auto", choices=DEVICES, help="auto (cuda if available), cpu or cuda")
    evaluate.add_argument("--eval-prompts-file", metavar="FILE", help="held-out prompts (default: the run's)")
    evaluate.add_argument(
        "--reward-fn", metavar="SPEC", help="module:function or file.py:function (default: the run's)"
    )
    sample.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeat for more)")
    sample.add_argument("--prompts-file", metavar="FILE", help="prompts, in --prompts-file's formats")
    sample.add_argument("--max-new-tokens", type=int, metavar="N", help="default: the run's response length")
    sample.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")


def config_from_args(args: argparse.Namespace) -> TrainerConfig:
    """File values (``--config``) first, then every flag given on the command line."""
    values = read_config_file(args.config) if getattr(args, "config", None) else {}
    source = f"--config {args.config}" if getattr(args, "config", None) else "config"
    config = TrainerConfig.from_dict(values, source=source)
    for f in dataclasses.fields(TrainerConfig):
        given = getattr(args, f.name, None)
        if given is not None:
            setattr(config, f.name, given)
    return config.validate()


def _values(f: dataclasses.Field) -> str:
    """What a field takes, as declared at it: its choices or its bounds."""
    if "choices" in f.metadata:
        return ", ".join(f"`{c}`" for c in f.metadata["choices"])
    return f.metadata.get("bounds") or f.metadata.get("values", "")


def options_markdown() -> str:
    """The options as a Markdown table (for the README), generated from the dataclass."""
    lines = ["| Option | Default | Values | Description |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(TrainerConfig):
        lines.append(f"| `{flag(f.name)}` | `{f.default}` | {_values(f)} | {f.metadata['help']} |")
    return "\n".join(lines)
