"""Callbacks: code of the user's called by the trainer's loop (``PPOTrainer(cfg, callbacks=[...])``).

A callback is any object with some of these methods (each optional):

* ``on_step_end(trainer, row)``: after each iteration, with its metrics row (the held-out scores
  in it on an evaluation step); returning ``True`` stops the run cleanly after this step: its
  checkpoint is saved and the final held-out evaluation runs, as at the last ``--steps``;
* ``on_evaluate(trainer, scores)``: after each held-out evaluation, with its scores;
* ``on_save(trainer, path)``: after each checkpoint is written, with its folder.

Under ``torchrun`` every rank calls them, and one rank's ``True`` stops them all.
"""

from __future__ import annotations

from collections.abc import Sequence

HOOKS = ("on_step_end", "on_evaluate", "on_save")


def checked(callbacks: Sequence) -> list:
    """``callbacks`` as a list; ``TypeError`` for one that has none of the hooks (a typo, a class given
    instead of an instance)."""
    for callback in callbacks:
        if isinstance(callback, type):
            raise TypeError(f"callbacks: {callback.__name__} is a class; give an instance ({callback.__name__}())")
        if not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
            raise TypeError(f"callbacks: {callback!r} has none of the methods {', '.join(HOOKS)}")
    return list(callbacks)


def notify(callbacks: Sequence, hook: str, *args) -> bool:
    """Call ``hook`` on each callback that has it; whether one asked to stop (returned True)."""
    stop = False
    for callback in callbacks:
        method = getattr(callback, hook, None)
        if method is not None:
            stop = method(*args) is True or stop
    return stop
