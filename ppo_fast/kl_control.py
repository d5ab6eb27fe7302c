"""KL coefficient controllers (Ziegler et al. 2019, as in TRL and verl)."""

from __future__ import annotations

from . import _validation as check


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = check.real("kl_coef", kl_coef, low=0.0)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing changes; kept so that both controllers are used alike."""


class AdaptiveKLController:
    """Move the KL coefficient so that the measured KL tracks ``target_kl``.

    ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)``; ``value *= 1 + e * n_steps / horizon``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        self.value = check.real("init_kl_coef", init_kl_coef, low=0.0)
        self.target = check.real("target_kl", target_kl, low=0.0, low_open=True)
        self.horizon = check.real("horizon", horizon, low=0.0, low_open=True)

    def update(self, current_kl: float, n_steps: int) -> None:
        current_kl = check.real("current_kl", current_kl)
        if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 0:
            raise ValueError(f"n_steps must be a non-negative int, got {n_steps!r}")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
