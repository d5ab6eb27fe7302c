"""What ``--resume`` does with an option whose value differs from the one the run was started with.

Every option applies from the resumed step on (the learning rate, weight decay and schedule
are set on the restored optimizer, a changed ``--kl-coef`` replaces the current coefficient),
except those below, which would silently make another run: they are refused with one line.
"""

from __future__ import annotations

from .config import CRITIC_METHODS, ConfigError, TrainerConfig, flag

# Refused in every run.
REFUSED = {
    "seed": "the run's random streams continue from the checkpoint",
    "critic": "the critic's weights and optimizer state have that layout",
    "parallel": "fsdp checkpoints are sharded, ddp ones are not",
}
# Refused for the built-in task: they make another warm-up model, and so another KL reference
# (and, for the seed and eval_size, another held-out split).
REFUSED_BUILTIN = ("sft_steps", "sft_batch_size", "sft_learning_rate", "demo_carry_error_rate", "eval_size")
# Not compared: where the run is, how it was started there, how long it goes on, and what it prints.
IGNORED = ("output_dir", "resume", "overwrite", "steps", "verbose", "debug", "report_to")


def check(saved: dict, cfg: TrainerConfig, builtin: bool, where: str) -> list[str]:
    """``ConfigError`` for a refused change; else the applied changes as ``name old -> new``."""
    changed = {
        name: old
        for name, old in saved.items()
        if name not in IGNORED and hasattr(cfg, name) and getattr(cfg, name) != old
    }
    refused = dict(REFUSED)
    if builtin:
        refused.update(
            {name: "the built-in task's warm-up model (the KL reference) depends on it" for name in REFUSED_BUILTIN}
        )
    old_method = saved.get("advantage_method", cfg.advantage_method)
    if (old_method in CRITIC_METHODS) != cfg.uses_critic:
        refused["advantage_method"] = "with a critic" if old_method in CRITIC_METHODS else "without a critic"
    for name, old in changed.items():
        if name in refused:
            raise ConfigError(
                f"{where} was trained with {flag(name)} {_show(old)} ({refused[name]}); resume with "
                f"{flag(name)} {_show(old)}, or start a new run in another --output-dir"
            )
    return [f"{name} {old!r} -> {getattr(cfg, name)!r}" for name, old in changed.items()]


def _show(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def apply_optimizer_options(optimizer, scheduler, cfg: TrainerConfig, lr_factor) -> None:
    """Set this run's learning rate, weight decay and schedule on a restored optimizer and scheduler
    (their state dicts hold the values the run was started with)."""
    scheduler.base_lrs = [cfg.learning_rate] * len(optimizer.param_groups)
    lrs = []
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.learning_rate
        group["weight_decay"] = cfg.weight_decay
        group["lr"] = cfg.learning_rate * lr_factor(scheduler.last_epoch)
        lrs.append(group["lr"])
    scheduler._last_lr = lrs
