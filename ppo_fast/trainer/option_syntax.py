"""How the options are written on the command line and in config files: the flag of a field, the names
renamed to the ops' (still accepted for a release, with a warning), other trainers' names for ours, and
a value read from text as its field's type.  Standard library only (``config.py`` loads it, alone too:
see there)."""

from __future__ import annotations

import sys
import typing


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
