"""The policy-loss registry: one entry per loss mode, the single source of truth for the
public op (``pf.policy_loss``), the backends, the trainer's ``--policy-loss`` choices and
help, the conformance matrix and the benchmarks.

An entry names the contract op that implements the mode (each backend declares in its
``SUPPORTED`` which of these ops it serves, so ``auto`` falls back to the reference per
mode), the mode's parameters with their defaults and ranges, and the stats it reports.
Every implementation of a mode has the signature

    fn(logprobs, old_logprobs, advantages, mask, weights, *params, agg) -> (loss, *stats)

with ``params`` in the entry's order (validated and defaulted by :meth:`PolicyLossMode.bind`).

Adding a mode: one entry here, its reference function (``ppo_fast.reference``, named by
``op``) and one case in ``tests/test_policy_losses.py``; the conformance matrix, the
trainer and the benchmarks pick it up from here.  The modes follow verl 0.9.1's
``get_policy_loss_fn`` definitions; where ours differ, ``note`` says how.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import _validation as check

# The stats of the clipped losses (verl's pg_clipfrac, pg_clipfrac_lower and ppo_kl).
CLIP_STATS = ("clipfrac", "clipfrac_lower", "approx_kl")


@dataclass(frozen=True)
class Param:
    """A float parameter of a loss mode.  ``default=None`` with ``optional`` means "off";
    ``same_as`` names the parameter whose value it takes when not given."""

    name: str
    default: float | None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    optional: bool = False
    same_as: str | None = None
    doc: str = ""

    def check(self, value):
        if value is None:
            return None
        return check.real(self.name, value, low=self.low, high=self.high, low_open=self.low_open, high_open=self.high_open)


CLIP_EPS_LOW = Param("clip_eps_low", 0.2, 0.0, 1.0, low_open=True, high_open=True, doc="ratio clip below 1 (1 - clip_eps_low)")
CLIP_EPS_HIGH = Param("clip_eps_high", None, 0.0, low_open=True, same_as="clip_eps_low", doc="ratio clip above 1 (1 + clip_eps_high)")
DUAL_CLIP = Param("dual_clip", None, 1.0, low_open=True, optional=True, doc="dual-clip bound c > 1 for A < 0 (None: off)")
# The two DPPO-Binary modes share the ratio truncation and verl's note on it.
DPPO_RATIO_CAP = Param("ratio_cap", 20.0, 0.0, low_open=True, doc="truncation of the (detached) ratio")
DPPO_NOTE = "verl reads ratio_cap from actor.clip_ratio_c (3.0 in its config, 20.0 its function's fallback)"


@dataclass(frozen=True)
class PolicyLossMode:
    name: str
    op: str  # the contract op that implements it on each backend
    summary: str
    params: tuple[Param, ...] = ()
    stats: tuple[str, ...] = CLIP_STATS
    default_agg: str = "token-mean"
    sequence_level: bool = False  # a per-sequence reduction before the ratio (GSPO, GMPO)
    syncs_host: bool = False  # data-dependent selection (a host sync on CUDA, as in verl)
    note: str = ""  # how it differs from verl's mode, if at all

    def bind(self, given: dict) -> tuple:
        """The mode's parameters, in order, from ``given`` (validated, defaults filled in)."""
        names = [p.name for p in self.params]
        unknown = sorted(set(given) - set(names))
        if unknown:
            takes = ", ".join(names) or "no parameters"
            raise TypeError(f"policy loss mode {self.name!r} takes {takes}; got unexpected {', '.join(unknown)}")
        values: dict[str, float | None] = {}
        for p in self.params:
            value = given.get(p.name, p.default)
            if value is None and p.same_as is not None:
                value = values[p.same_as]
            if value is None and not p.optional:
                raise TypeError(f"policy loss mode {self.name!r} needs {p.name} ({p.doc})")
            values[p.name] = p.check(value)
        return tuple(values.values())


POLICY_LOSS_MODES: dict[str, PolicyLossMode] = {
    mode.name: mode
    for mode in (
        PolicyLossMode(
            "vanilla", "clipped_policy_loss", "PPO clipped surrogate, asymmetric and dual clip",
            (CLIP_EPS_LOW, CLIP_EPS_HIGH, DUAL_CLIP),
            note="verl always applies its dual clip (clip_ratio_c=3.0); here dual_clip=None means off, dual_clip=3.0 is verl's",
        ),
        PolicyLossMode(
            "gspo", "policy_loss_gspo", "GSPO: the clipped loss on the sequence-level ratio exp(mean_t log r_t)",
            (CLIP_EPS_LOW, CLIP_EPS_HIGH), sequence_level=True,
        ),
        PolicyLossMode(
            "geo_mean", "policy_loss_geo_mean",
            "GMPO: geometric mean of the token-clipped ratios (log space) times the row's mean advantage",
            (CLIP_EPS_LOW, CLIP_EPS_HIGH), default_agg="seq-mean-token-mean", sequence_level=True,
            note="verl takes the mean over all rows whatever loss_agg_mode says (a row without tokens counts as a 0); "
            "here the row loss is aggregated by agg (default seq-mean-token-mean: rows without tokens do not count)",
        ),
        PolicyLossMode(
            "sapo", "policy_loss_sapo", "SAPO: a sigmoid gate of the ratio instead of the clip",
            (Param("tau_pos", 1.0, 0.0, low_open=True, doc="gate temperature where A > 0"),
             Param("tau_neg", 1.05, 0.0, low_open=True, doc="gate temperature where A <= 0")),
            default_agg="seq-mean-token-mean",
            note="verl always aggregates SAPO with seq-mean-token-mean; that is the default agg here, and the others are accepted",
        ),
        PolicyLossMode(
            "cispo", "policy_loss_cispo", "CISPO: -sg(clip(ratio)) * A * log-prob",
            (CLIP_EPS_LOW, CLIP_EPS_HIGH),
        ),
        PolicyLossMode("gpg", "policy_loss_gpg", "GPG: -A * log-prob (no ratio)", stats=()),
        PolicyLossMode(
            "clip_cov", "policy_loss_clip_cov",
            "Clip-Cov: the clipped loss with a random few high-covariance tokens' gradient cut",
            (CLIP_EPS_LOW, CLIP_EPS_HIGH,
             Param("clip_cov_ratio", 0.0002, 0.0, 1.0, low_open=True, doc="fraction of tokens to cut"),
             Param("clip_cov_lb", 1.0, doc="covariance lower bound of the candidates"),
             Param("clip_cov_ub", 5.0, doc="covariance upper bound of the candidates")),
            stats=("clipfrac", "approx_kl"), syncs_host=True,
            note="the cut tokens are drawn with torch.randperm from torch's default CPU generator, as in verl",
        ),
        PolicyLossMode(
            "kl_cov", "policy_loss_kl_cov",
            "KL-Cov: the unclipped loss plus ppo_kl_coef * abs(log r) on the top-covariance tokens",
            (Param("kl_cov_ratio", 0.0002, 0.0, 1.0, low_open=True, doc="fraction of tokens penalised"),
             Param("ppo_kl_coef", 0.1, 0.0, doc="coefficient of |log r| on them")),
            stats=("approx_kl_abs",), syncs_host=True,
            note="verl reports the mean abs(log r) as ppo_kl; here it is approx_kl_abs",
        ),
        PolicyLossMode(
            "dppo_tv", "policy_loss_dppo_tv",
            "DPPO-Binary-TV: -A * sg(min(ratio, ratio_cap)) * log-prob on tokens within a probability-difference trust region",
            (Param("clip_eps_low", 0.2, 0.0, low_open=True, doc="allowed probability decrease (A < 0)"),
             Param("clip_eps_high", None, 0.0, low_open=True, same_as="clip_eps_low", doc="allowed probability increase (A > 0)"),
             DPPO_RATIO_CAP),
            note=DPPO_NOTE,
        ),
        PolicyLossMode(
            "dppo_kl", "policy_loss_dppo_kl",
            "DPPO-Binary-KL: as dppo_tv with a binary-KL trust region",
            (Param("clip_eps_low", 0.2, 0.0, low_open=True, doc="allowed binary KL where A < 0"),
             Param("clip_eps_high", None, 0.0, low_open=True, same_as="clip_eps_low", doc="allowed binary KL where A > 0"),
             DPPO_RATIO_CAP),
            note=DPPO_NOTE,
        ),
        PolicyLossMode(
            "dro", "policy_loss_dro", "DRO: -(A * log-prob - dro_beta/2 * (log r)^2)",
            (Param("dro_beta", None, 0.0, low_open=True, doc="weight of the quadratic log-ratio penalty, > 0"),),
            stats=("approx_kl",),
        ),
    )
}

POLICY_LOSS_OPS = tuple(dict.fromkeys(mode.op for mode in POLICY_LOSS_MODES.values()))


def policy_loss_mode(name) -> PolicyLossMode:
    """The registry entry of ``name``; ``ValueError`` listing the modes otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"loss_mode must be a str, one of {tuple(POLICY_LOSS_MODES)}, got {type(name).__name__} {name!r}")
    if name not in POLICY_LOSS_MODES:
        raise ValueError(f"loss_mode must be one of {tuple(POLICY_LOSS_MODES)}, got {name!r}")
    return POLICY_LOSS_MODES[name]


def describe(mode: PolicyLossMode) -> str:
    """One line: the mode, its parameters with defaults, and what it computes (for --help)."""
    params = ", ".join(f"{p.name}={p.same_as if p.default is None and p.same_as else p.default}" for p in mode.params)
    return f"{mode.name}({params}): {mode.summary}"

