"""How the options are written on the command line and in config files: the flag of a field, the names
renamed to the ops' (still accepted for a release, with a warning), other trainers' names for ours, and
a value read from text as its field's type.  Standard library only (``config.py`` loads it, alone too:
see there)."""

from __future__ import annotations

import json
import math
import sys
import typing
from pathlib import Path


class ConfigError(ValueError):
    """A user error: a bad option value, or an input file or path that cannot be used.

    The ``ppo-fast`` command prints it as one ``ppo-fast: error: ...`` line."""


def flag(name: str) -> str:
    """The command-line flag of a config field: ``kl_coef`` -> ``--kl-coef``."""
    return "--" + name.replace("_", "-")


# Options renamed to the ops' names (old -> new): the old flag and config key still work, with a
# one-line warning, until the next release.
RENAMED = {
    "policy_loss": "loss_mode",
    "policy_loss_params": "loss_mode_params",
    "loss_agg": "agg",
    "ent_coef": "entropy_coef",
    "cliprange_value": "value_clip",
    "num_samples_per_prompt": "group_size",
    "grpo_norm_by_std": "norm_by_std",
}
# Other trainers' names for our options, accepted with a warning: TRL's one ratio clip sets both of ours.
ALIASES = {"cliprange": ("clip_eps_low", "clip_eps_high")}


def alias_warning(name: str) -> str:
    new = " and ".join(flag(n) for n in ALIASES[name])
    return f"ppo-fast: warning: {flag(name)} (TRL's name) sets {new}; use those"


def renamed_warning(old: str, source: str | None = None) -> str:
    """``--policy-loss is now --loss-mode; ...`` (a flag), or with ``source`` the config key's."""
    what = f"{source}: {old} is now {RENAMED[old]}" if source else f"{flag(old)} is now {flag(RENAMED[old])}"
    return f"ppo-fast: warning: {what}; the old name goes in the next release"


def current_names(values: dict, source: str) -> dict:
    """``values`` with the renamed options' old keys under their new names (a warning each)."""
    out = {}
    for name, value in values.items():
        if name in ALIASES:
            print(alias_warning(name), file=sys.stderr)
            out.update(dict.fromkeys(ALIASES[name], value))
            continue
        if name in RENAMED:
            print(renamed_warning(name, source), file=sys.stderr)
            name = RENAMED[name]
        out[name] = value
    return out


def base_type(hint):
    """``int`` for ``int``, ``str`` for ``str | None``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def coerce(name: str, value, hint, source: str):
    """``value`` as the field's type: ints for float fields, and numbers written as
    strings ('1e-4', '100') for int and float fields; else ``ConfigError``."""
    base = base_type(hint)
    if value is None and base is not hint:
        return None
    if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if base is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if base in (int, float) and isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            pass
        else:
            if base is float:
                return number
            if number.is_integer():
                return int(number)
    if isinstance(value, base) and not (base is not bool and isinstance(value, bool)):
        return value
    kind = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[base]
    raise ConfigError(f"{source}: {name} must be {kind} ({base.__name__}), got {value!r}")


def read_config_file(path: str | Path) -> dict:
    """The ``{field: value}`` mapping of a YAML or JSON config file; ``ConfigError`` if unreadable."""
    path = Path(path)
    where = f"--config {path}"
    if not path.is_file():
        raise ConfigError(f"{where}: no such file")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            values = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"{where}: not valid YAML: {' '.join(str(err).split())}") from None
    else:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{where}: not valid JSON ({err}); YAML files must end in .yaml or .yml") from None
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: expected a mapping of option names to values (like `kl_coef: 0.05`)")
    return values


def invalid(name: str, message: str) -> ConfigError:
    """The error of a bad value of the field ``name``."""
    return ConfigError(f"invalid config: {name} ({flag(name)}) {message}")


def pairs(field_name: str, text: str) -> list[tuple[str, str]]:
    """The ``name=value`` pairs of a comma-separated field's ``text`` (``ConfigError`` naming the field)."""
    found = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not (sep and name.strip() and value.strip()):
            raise invalid(field_name, f"must be name=value pairs separated by commas, got {item!r}")
        found.append((name.strip(), value.strip()))
    return found


def number(field_name: str, name: str, text: str) -> float:
    """``text`` as a finite number (``ConfigError`` naming the field and the pair's name)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if value != value or value in (float("inf"), float("-inf")):
        raise invalid(field_name, f"{name} must be a finite number, got {text!r}")
    return value


def _require(name: str, ok: bool, message: str) -> None:
    if not ok:
        raise invalid(name, message)


def loss_mode_param_values(text: str) -> dict[str, float]:
    """``--loss-mode-params`` as ``{name: value}`` (which names the mode takes is checked against
    the registry by ``loss_mode_kwargs``); the clips have flags of their own."""
    values = {name: number("loss_mode_params", name, value) for name, value in pairs("loss_mode_params", text)}
    for name in set(values) & {"clip_eps_low", "clip_eps_high", "dual_clip"}:
        _require("loss_mode_params", False, f"takes no {name}: give {flag(name)}")
    return values


def loss_mode_kwargs(cfg, mode) -> dict:
    """The keyword parameters of ``cfg.loss_mode``'s registry entry ``mode``: the clips it takes and
    ``--loss-mode-params``, bound by the registry (without torch)."""
    takes = {p.name for p in mode.params}
    clips = {"clip_eps_low": cfg.clip_eps_low, "clip_eps_high": cfg.clip_eps_high, "dual_clip": cfg.dual_clip}
    for name in ("clip_eps_high", "dual_clip"):
        _require(name, clips[name] is None or name in takes, f"does not apply to --loss-mode {cfg.loss_mode}")
    params = {name: value for name, value in clips.items() if name in takes and value is not None}
    for p in mode.params:  # the clips' bounds are the mode's (a trust region's size is not a ratio's)
        if p.name in clips and p.name in params:
            try:
                p.check(params[p.name])
            except ValueError as err:
                _require(p.name, False, f"{str(err).removeprefix(p.name + ' ')} (--loss-mode {cfg.loss_mode})")
    params.update(loss_mode_param_values(cfg.loss_mode_params))
    try:
        mode.bind(params)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"invalid config: --loss-mode {cfg.loss_mode}: {err}") from None
    return params


def advantage_kwargs(cfg, takes: dict) -> dict:
    """``--advantage-params`` as keyword parameters of a method taking ``takes`` (its registry's
    ``{name: default}``), typed by the defaults."""
    own = {"norm_by_std": "--norm-by-std", "gamma": "--gamma"}
    values = {}
    for name, text in pairs("advantage_params", cfg.advantage_params):
        _require("advantage_params", name not in own, f"takes no {name}: give {own.get(name)}")
        settable = sorted(set(takes) - set(own) - {"baselines"})
        _require(
            "advantage_params",
            name in settable,
            f"--advantage-method {cfg.advantage_method} takes {', '.join(settable) or 'no parameters'}; got {name!r}",
        )
        if isinstance(takes[name], bool):
            _require("advantage_params", text.lower() in ("true", "false"), f"{name} must be true or false")
            values[name] = text.lower() == "true"
        else:
            values[name] = number("advantage_params", name, text)
    return values


def validate_lora(cfg, defaults: dict, all_linear: str, head_names: tuple) -> None:
    """The LoRA options (``defaults``: the lora_* fields' defaults): only with --lora-r, never on the LM
    head (``head_names``), dropout only where it is kept."""
    if cfg.lora_r is None:
        for name in (n for n in defaults if n != "lora_r"):
            _require(name, getattr(cfg, name) == defaults[name], "needs --lora-r (LoRA is off without it)")
        return
    targets = cfg.lora_targets()
    _require("lora_target_modules", bool(targets), "names no module; give names such as q_proj,v_proj")
    head = [name for name in ([] if targets == all_linear else targets) if name.split(".")[-1] in head_names]
    _require(
        "lora_target_modules",
        not head,
        f"adapts the LM head ({', '.join(head)}): the fused head reads the base's weight; leave it out",
    )
    _require(
        "lora_dropout",
        cfg.lora_dropout == 0 or not cfg.disable_dropout,
        "is set to 0 by --disable-dropout (the default); pass --no-disable-dropout to train with it",
    )
    _require(
        "shard_reference",
        not cfg.shard_reference,
        "does not apply with --lora-r: the reference is the policy with its adapters off (no copy to shard)",
    )


def validate_reward_weights(cfg) -> None:
    """``--reward-weights``: one finite number per reward (the functions, then the reward model)."""
    try:
        weights = cfg.reward_weight_values()
    except ValueError:
        weights = []
    count = len(cfg.reward_fns()) + (cfg.reward_model is not None)
    ok = len(weights) == count and all(map(math.isfinite, weights))
    why = f"must be {count} finite number(s) separated by commas (one per --reward-fn function, then --reward-model)"
    _require("reward_weights", ok, f"{why}, got {cfg.reward_weights!r}")


def validate_rewards_and_trackers(cfg, report_to: tuple) -> None:
    """``--reward-fn``'s specs and ``--report-to``'s names (``report_to``: the known ones)."""
    for spec in cfg.reward_fns():
        module, _, function = spec.rpartition(":")
        _require(
            "reward_fn",
            bool(module and function),
            f"must look like 'module:function' or 'path/to/file.py:function' (several: separated by commas), "
            f"got {spec!r}",
        )
    validate_reward_weights(cfg)
    names = [name.strip() for name in cfg.report_to.split(",")]
    alone = len(names) == 1 or not {"auto", "none"} & set(names)
    _require("report_to", set(names) <= set(report_to) and alone, f"must be auto, none or of {report_to[2:]}")


def validate_rollout_device(cfg) -> None:
    """``--rollout-device``: auto or cuda:N, and only for the producer of ``--max-staleness`` > 0 (with the
    trainer's device, checked at the start: ``weight_transfer.resolve``)."""
    device = cfg.rollout_device
    index = device.removeprefix("cuda:")
    _require(
        "rollout_device",
        device == "auto" or (index != device and index.isdigit()),
        f"must be auto or cuda:N, got {device!r}",
    )
    for name, default in (("rollout_device", "auto"), ("weight_transfer", "auto")):
        _require(
            name,
            getattr(cfg, name) == default or cfg.max_staleness > 0,
            "only applies to the producer of --max-staleness > 0 (it is 0)",
        )


def validate_partial_rollouts(cfg, engine, engines_with) -> None:
    """``--partial-rollouts``: a continued response's prefix was sampled by older weights, so it needs the
    producer's staleness bound (``--max-staleness`` > 0), an engine that continues a response from its tokens,
    and no ``--stop-strings`` (a stop string could span the rounds' boundary).  ``--partial-rollout-seconds``
    bounds those rounds, so it needs them, and an engine that can end a round mid-generation.
    ``engines_with(capability)``: the engines that have it, as the refusal names them."""
    if cfg.partial_rollout_seconds:
        _require("partial_rollout_seconds", cfg.partial_rollouts > 0, "bounds the rounds of --partial-rollouts N")
        _require("partial_rollout_seconds", engine.round_seconds, f"needs {engines_with('round_seconds')}")
    if not cfg.partial_rollouts:
        return
    _require(
        "partial_rollouts",
        cfg.max_staleness > 0,
        "continues responses under newer weights, so it needs asynchronous rollouts: --max-staleness 1 or more "
        "(it bounds the age of each response's oldest token)",
    )
    _require("partial_rollouts", engine.continues, f"needs {engines_with('continues')}")
    _require("partial_rollouts", not cfg.stop_strings, "and --stop-strings cannot be used together")


def string_list(field_name: str, text: str) -> list[str]:
    """``a,b`` or a JSON list of non-empty strings (for ones with commas); ``[]`` for an empty text."""
    text = text.strip()
    if text.startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as err:
            raise invalid(field_name, f"is not a JSON list: {err}") from None
        _require(field_name, isinstance(values, list) and all(isinstance(v, str) for v in values), "must list strings")
    else:
        values = [v.strip() for v in text.split(",")] if text else []
    _require(field_name, all(values), f"has an empty string: {text!r}")
    return values


def json_object(field_name: str, text: str) -> dict:
    """A JSON object's text as a dict; ``{}`` for an empty text."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise invalid(field_name, f"is not JSON: {err}") from None
    _require(
        field_name,
        isinstance(value, dict),
        f"must be a JSON object such as '{{\"no_repeat_ngram_size\": 3}}', got {text!r}",
    )
    return value
