"""The op inputs, one implementation for the conformance matrix (tests/test_conformance.py) and the
fuzzer (tests/test_fuzz.py): a builder per op draws its inputs in float64 (exactly representable in
the example's dtype) and says which positions the op never reads; ``poisoned`` puts NaN/inf there or
at one valid position; ``run`` lays the inputs out (contiguous, sliced: every other column of a
storage twice as wide, whose gaps hold NaN or an out-of-range label, so that a kernel reading them
is caught; transposed; expanded: stride 0), calls the public op on a backend and takes the gradients
of a random projection of its outputs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

import ppo_fast as pf
from ppo_fast.advantage_methods import REGISTRY as ADVANTAGE_METHODS
from ppo_fast.spec import KL_ESTIMATORS, POLICY_LOSS_MODES

F64 = torch.float64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": F64}
LAYOUTS = ("contiguous", "sliced", "transposed", "expanded")


def laid_out(values: torch.Tensor, layout: str) -> tuple[torch.Tensor, Callable]:
    """``(leaf, view_of)``: ``view_of(leaf)`` holds ``values`` in ``layout`` (sliced: the gaps hold junk)."""
    if layout == "sliced":  # every other column (row, for 1-D) of a storage twice as wide
        junk = math.nan if values.is_floating_point() else (True if values.dtype == torch.bool else -(2**40))
        view_of = (lambda t: t[:, 1::2]) if values.dim() > 1 else (lambda t: t[1::2])
        shape = list(values.shape)
        shape[min(1, values.dim() - 1)] *= 2
        wide = torch.full(shape, junk, dtype=values.dtype, device=values.device)
        view_of(wide).copy_(values)
        return wide, view_of
    if layout == "transposed" and values.dim() > 1:
        return values.transpose(0, 1).contiguous(), lambda t: t.transpose(0, 1)
    if layout == "expanded" and values.dim() > 0 and values.shape[0] > 0:
        return values[:1].clone(), lambda t: t.expand(values.shape)
    return values.clone(), lambda t: t


@dataclasses.dataclass(frozen=True)
class Spec:
    """One example: what Hypothesis draws (its repr is the falsifying example)."""

    backend: str
    dtype: str
    layout: str
    poison: str  # clean | masked | valid nan/inf/-inf | bad_label
    dims: tuple
    knobs: dict  # the op's hyper-parameters and input distributions
    seed: int = 0
    poison_input: int = 0  # which float input a valid-position poison goes into
    second_order: bool = False
    device: str = "cpu"
    all_masked: bool = False  # every mask 0, every label ignored


@dataclasses.dataclass
class Input:
    values: torch.Tensor  # float64, logical shape, exactly representable in the spec's dtype
    grad: bool = True
    masked: torch.Tensor | None = None  # positions the op never reads (bool, values' shape)
    layout: str | None = None  # a layout of its own (else the spec's)


@dataclasses.dataclass
class Built:
    inputs: dict[str, Input]
    others: dict[str, torch.Tensor]  # labels, masks, group ids (laid out like the floats; 1-D ones not expanded)
    call: Callable[[dict], tuple]  # the public op on the laid-out tensors
    differentiable: tuple[int, ...] = (0,)
    zero_out: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # output -> positions exactly 0
    kl_ratio: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # output -> log-ratio (KL rule)
    # output -> an error any evaluation in the compute dtype may make (the float32 rounding of a product's logits)
    rounding: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    # the float64 reference's own absolute error on the gradients, where its softmax backward cancels
    # terms of the logits' scale (a near-certain row's entropy gradient: -1 - (-1) for a 1e-28 truth)
    grad_floor: float = 0.0
    # the gradients' error, relative to their largest entry, that the rounding behind ``rounding`` makes
    grad_rounding: float = 0.0


# --------------------------------------------------------------------------- input distributions


def alike(t: torch.Tensor, spec: Spec) -> torch.Tensor:
    """Every row the first under the expanded layout, where an input's rows are one row: a mask or
    labels alike keep the positions the op never reads where they are."""
    return t[:1].expand_as(t).clone() if spec.layout == "expanded" and t.dim() and t.shape[0] else t


def mask_of(gen, shape, spec: Spec) -> torch.Tensor:
    """Interior holes, an all-masked first row and a full last row (when there are rows and they may differ)."""
    mask = torch.rand(shape, generator=gen) < 0.65
    if shape[0] > 1 and spec.layout != "expanded":
        mask[0], mask[-1] = False, True
    return alike(mask, spec) & (not spec.all_masked)


def log_ratio(gen, shape, mode: str) -> torch.Tensor:
    """log-ratios: normal, tiny (|r| in [1e-4, 1e-3]), wide (beyond the +-20 clamps) or huge (85 to 92: exp overflows float32)."""
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0).double()
    u, moderate, wide = torch.rand(shape, generator=gen, dtype=F64), normal(gen, shape) * 0.5, normal(gen, shape) * 30
    return {"normal": moderate, "tiny": sign * 10 ** (u - 4), "wide": wide, "huge": 85 + 7 * u}[mode]


# float32 log-ratios whose exp lies within 1e-5 ulp of a float32 (found by search), so every
# backend's float32 exp gives the same ratio; the clip epsilons that put a bound exactly there
# (1 - r and r - 1 are exact in double).
CLIP_BOUND_TIES = {"low": (-0.28789985179901123, 0.7498366832733154), "high": (0.22954288125038147, 1.25802481174469)}
CLIP_BOUND_TIE_EPS = {
    "clip_eps_low": 1.0 - CLIP_BOUND_TIES["low"][1],
    "clip_eps_high": CLIP_BOUND_TIES["high"][1] - 1.0,
}


def clip_bound_ties(adv: torch.Tensor) -> torch.Tensor:
    """Log-ratios on the bound where the clipped surrogate is smooth (1 - eps where A > 0, 1 + eps
    where A < 0), so an ulp's move of the inputs moves no gradient: a backend that halves the
    gradient there is off by half, beyond any tolerance (the kinks: tests/test_edge_values.py)."""
    low, high = CLIP_BOUND_TIES["low"][0], CLIP_BOUND_TIES["high"][0]
    return torch.where(adv > 0, low, high).double()


def normal(gen, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=F64)


def rounded(x: torch.Tensor, spec: Spec) -> torch.Tensor:
    return x.to(DTYPES[spec.dtype]).double()


def labels_of(gen, logits64, spec, k) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels, ignored)``: random or greedy (argmax) token ids, some set to ignore_index."""
    vocab = logits64.shape[-1]
    labels = torch.randint(0, vocab, logits64.shape[:-1], generator=gen)
    greedy = logits64.argmax(-1) if logits64.numel() else labels
    pick = {"random": 0.0, "greedy": 1.0, "mixed": 0.5}[k["labels"]]
    labels = torch.where(torch.rand(labels.shape, generator=gen) < pick, greedy, labels)
    ignored = k["ignored"] if not spec.all_masked else 1.0
    labels = torch.where(torch.rand(labels.shape, generator=gen) < ignored, k["ignore_index"], labels)
    if spec.poison == "bad_label" and labels.numel():
        bad = vocab if k["ignore_index"] != vocab else -7
        first = labels[:1].numel() if spec.layout == "expanded" else labels.numel()
        labels.view(-1)[torch.randint(0, first, (1,), generator=gen)] = bad
    labels = alike(labels, spec)
    return labels, labels == k["ignore_index"]


# --------------------------------------------------------------------------- the ops (one builder each)


def named(k: dict, *names: str) -> dict:
    """The knobs ``names`` (keyword arguments of the op by the same names)."""
    return {name: k[name] for name in names}


def masked_by(mask: torch.Tensor, grad: bool = True, **values) -> dict[str, Input]:
    """Inputs of the mask's shape, read where the mask is set."""
    return {name: Input(x, grad, masked=~mask) for name, x in values.items()}


def flat(out) -> tuple:
    """An op's result as a tuple of tensors (a loss's stats in order)."""
    out = (out,) if isinstance(out, torch.Tensor) else out
    return tuple(x for o in out for x in (o.values() if isinstance(o, dict) else (o,)))


def calling(fn: Callable, names: str, **kwargs) -> Callable[[dict], tuple]:
    """``fn`` on the laid-out tensors: ``names`` (space-separated) in order (None where absent), every
    other one by its name, then ``kwargs``; its outputs as a tuple."""
    names = names.split()
    return lambda t: flat(fn(*(t.get(n) for n in names), **{n: x for n, x in t.items() if n not in names}, **kwargs))


def build_token_logprobs(spec, gen, k):
    B, T, V = spec.dims
    logits = rounded(normal(gen, B, T, V) * k["scale"], spec)
    labels, ignored = labels_of(gen, logits, spec, k)
    options = dict(named(k, "temperature", "ignore_index"), return_entropy=k["entropy"])
    call = calling(pf.token_logprobs, "logits labels", **options)
    inputs = {"logits": Input(logits, masked=ignored.unsqueeze(-1).expand(B, T, V))}
    # float64's own absolute error in a gradient: its terms are O(|z|) before they cancel (a near-certain
    # row's entropy gradient, whose truth may be 1e-21, comes out 0), as the fused heads' grad_floor.
    finite = logits[torch.isfinite(logits)]
    top = float(finite.abs().max()) if finite.numel() else 0.0
    floor = 64 * torch.finfo(F64).eps * top / k["temperature"]
    outputs = (0, 1) if k["entropy"] else (0,)
    return Built(inputs, {"labels": labels}, call, outputs, {0: ignored, 1: ignored}, grad_floor=floor)


def head_options(k: dict) -> dict:
    """The fused-head ops' options, from the knobs."""
    return dict(temperature=k["temperature"], logit_scale=k["logit_scale"], logit_softcap=k["softcap"])


def head_logits(u: torch.Tensor, k: dict) -> torch.Tensor:
    """A fused head's logits before the temperature, from its products ``u = hidden @ weight.T + bias``."""
    scaled = u * k["logit_scale"]
    return scaled if k["softcap"] is None else k["softcap"] * torch.tanh(scaled / k["softcap"])


def build_linear_token_logprobs(spec, gen, k):
    B, T, H, V = spec.dims
    hidden = rounded(normal(gen, B, T, H) * k["scale"], spec)
    weight = rounded(normal(gen, V, H) / H**0.5, spec)
    bias = rounded(normal(gen, V), spec) if k["bias"] else None
    labels, ignored = labels_of(gen, head_logits(hidden @ weight.T + (0 if bias is None else bias), k), spec, k)
    inputs = {"hidden": Input(hidden, masked=ignored.unsqueeze(-1).expand(B, T, H))}
    inputs["weight"] = Input(weight, layout=k["weight_layout"])
    if bias is not None:
        inputs["bias"] = Input(bias, layout="contiguous")
    options = dict(head_options(k), return_entropy=k["entropy"], ignore_index=k["ignore_index"])
    call = calling(pf.linear_token_logprobs, "hidden weight labels", **options)
    outputs = (0, 1) if k["entropy"] else (0,)
    return Built(inputs, {"labels": labels}, call, outputs, {0: ignored, 1: ignored}, **head_bounds(spec, k, inputs))


def head_bounds(spec, k, inputs, logprobs=True) -> dict:
    """A fused head's error bounds (``Built``).  Any float32 evaluation's z = logit_scale * u / T (or
    softcap * tanh(logit_scale * u / softcap) / T) may be off float64's by ``z_error``: a dot product of H
    terms by up to H eps sum|h_i w_i| (and its rounding, eps |u|; tanh is 1-Lipschitz), a softcap's tanh
    by a few ulps of its own value, times softcap / T.  A log-prob z_y - lse moves by at most twice the
    largest of its row; an entropy H by sum_j p_j |log p_j + H| times z_j's error to first order
    (dH/dz_j), so twice that plus (1 + log V) times the largest error squared (``rounding``); a
    gradient, relative to its largest entry, by about as much as z (``grad_rounding``).
    The float64 reference's own absolute error (``grad_floor``): each logit's gradient terms are
    O(logit_scale / T) before they cancel (a near-certain row's entropy gradient, -1 - (-1), where the
    truth is 1e-28); d_hidden sums V of them times |W|, d_weight the rows' times |h|."""
    hidden, weight = inputs["hidden"].values, inputs["weight"].values
    bias = inputs["bias"].values if "bias" in inputs else None
    eps = torch.finfo(torch.float32).eps if spec.dtype != "float64" else 0.0
    u = hidden @ weight.T + (0 if bias is None else bias)
    z = head_logits(u, k) / k["temperature"]
    spread = hidden.abs() @ weight.abs().T + (0 if bias is None else bias.abs())
    z_error = (hidden.shape[-1] * eps * spread + eps * u.abs()) * k["logit_scale"] / k["temperature"]
    if k["softcap"] is not None:
        z_error = z_error + 4 * eps * z.abs()
    top = lambda x: float(x.abs().max()) if x.numel() else 0.0  # noqa: E731
    terms = max(weight.shape[0], hidden.numel() // max(1, hidden.shape[-1]))
    floor = 64 * torch.finfo(F64).eps * k["logit_scale"] / k["temperature"] * top(hidden) * top(weight) * terms
    bounds = {"grad_floor": floor, "grad_rounding": 4 * top(z_error)}
    if not logprobs:
        return bounds
    rounding = {0: 2 * z_error.amax(-1)}
    if k.get("entropy"):
        logp = torch.log_softmax(z, -1)
        entropy = -(logp.exp() * logp).sum(-1, keepdim=True)
        first = (logp.exp() * (logp + entropy).abs() * z_error).sum(-1)
        rounding[1] = 2 * first + (1 + math.log(u.shape[-1])) * z_error.amax(-1) ** 2
    return {**bounds, "rounding": rounding}


def _pair(gen, spec, k, shape):
    logp = rounded(-normal(gen, shape).abs() * 2 - 0.01, spec)
    return logp, rounded(logp - log_ratio(gen, shape, k["ratio"]), spec)


def build_kl_estimate(spec, gen, k):
    """Every estimator (one output each) of the same log-probs."""
    logp, ref = _pair(gen, spec, k, spec.dims)
    call = lambda t: tuple(pf.kl_estimate(t["logprobs"], t["ref_logprobs"], e) for e in KL_ESTIMATORS)  # noqa: E731
    every = tuple(range(len(KL_ESTIMATORS)))
    inputs = {"logprobs": Input(logp), "ref_logprobs": Input(ref)}
    return Built(inputs, {}, call, every, kl_ratio=dict.fromkeys(every, logp - ref))


def build_kl_penalized_rewards(spec, gen, k):
    mask = mask_of(gen, spec.dims, spec)
    logp, ref = _pair(gen, spec, k, spec.dims)
    scores = Input(rounded(normal(gen, spec.dims[0]), spec), masked=~mask.any(-1), layout="contiguous")
    inputs = {"scores": scores, **masked_by(mask, logprobs=logp, ref_logprobs=ref)}
    call = calling(pf.kl_penalized_rewards, "scores logprobs ref_logprobs mask", **named(k, "kl_coef", "kl_estimator"))
    return Built(inputs, {"mask": mask}, call, (0, 1), {0: ~mask, 1: ~mask}, {1: torch.where(mask, logp - ref, 0.0)})


def build_gae(spec, gen, k):
    mask = mask_of(gen, spec.dims, spec)
    rewards, values = (rounded(normal(gen, spec.dims) * k["scale"], spec) for _ in range(2))
    call = calling(pf.gae, "rewards values mask", **named(k, "gamma", "lam"))
    return Built(masked_by(mask, rewards=rewards, values=values), {"mask": mask}, call, (0, 1), {0: ~mask, 1: ~mask})


def build_policy_loss(spec, gen, k):
    """A registered policy-loss mode (vanilla also through pf.clipped_policy_loss)."""
    mask = mask_of(gen, spec.dims, spec)
    old = rounded(-normal(gen, spec.dims).abs() * 2 - 0.05, spec)
    mode, entry = POLICY_LOSS_MODES[k["loss_mode"]], {"agg": k["agg"], **dict(k["params"])}
    adv = normal(gen, spec.dims) * k["adv_scale"]
    adv = rounded({"mixed": adv, "negative": -adv.abs(), "positive": adv.abs()}[k["adv_sign"]], spec)
    if k["ratio"] == "tie":  # every ratio exactly on a clip bound (float32 inputs): old 0, bounds set there
        old, logp = torch.zeros(spec.dims, dtype=F64), rounded(clip_bound_ties(adv), spec)
        names = {p.name for p in mode.params}
        entry |= {n: v for n, v in CLIP_BOUND_TIE_EPS.items() if n in names}
    else:
        logp = rounded(old + log_ratio(gen, spec.dims, k["ratio"]), spec)
    values = {"logprobs": logp, "old_logprobs": old, "advantages": adv}
    if k["weighted"]:
        values["weights"] = rounded(torch.rand(spec.dims, generator=gen, dtype=F64) * 2, spec)
    if k["entry"] == "clipped_policy_loss":
        loss = calling(pf.clipped_policy_loss, "logprobs old_logprobs advantages mask", **entry)
    else:
        loss = calling(pf.policy_loss, "logprobs old_logprobs advantages mask", loss_mode=mode.name, **entry)

    def call(t):
        if mode.syncs_host:
            torch.manual_seed(0)  # clip_cov draws the tokens it cuts from the default generator
        return loss(t)

    return Built(masked_by(mask, **values), {"mask": mask}, call)


def build_linear_policy_loss(spec, gen, k):
    """pf.linear_policy_loss with the KL and entropy terms: hidden states ``[B, T, H]`` through a
    ``[V, H]`` head; the rollout's tensors (old and reference log-probs, advantages, weights) are
    constants of the op.  The knob ``truncation`` (``((name, value), ...)`` of top_k / top_p / min_p,
    optional): the sampler's, and each row's likeliest token as its label (a token outside the kept set
    could not have been sampled: its log-prob is -inf)."""
    B, T, H, V = spec.dims
    mask = mask_of(gen, (B, T), spec)
    hidden = rounded(normal(gen, B, T, H) * k["scale"], spec)
    weight = rounded(normal(gen, V, H) / H**0.25, spec)
    labels = alike(torch.randint(0, V, (B, T), generator=gen), spec)
    inputs = {"hidden": Input(hidden, masked=~mask.unsqueeze(-1).expand(B, T, H))}
    inputs["weight"] = Input(weight, layout="contiguous")
    if k["bias"]:
        inputs["bias"] = Input(rounded(normal(gen, V), spec), layout="contiguous")
    truncation = dict(k.get("truncation") or ())
    if truncation and V:
        u = hidden @ weight.T + (inputs["bias"].values if k["bias"] else 0)
        labels = alike(head_logits(u, k).argmax(-1), spec)
    draw = lambda: normal(gen, B, T) * 0.5  # noqa: E731
    rollout = {"old_logprobs": -draw().abs() - 0.5, "ref_logprobs": -draw().abs() - 0.5, "advantages": draw()}
    if k["weighted"]:
        rollout["weights"] = draw().abs() * 2
    inputs.update(masked_by(mask, False, **{name: rounded(x, spec) for name, x in rollout.items()}))
    loss = named(k, "loss_mode", "agg", "kl_coef", "entropy_coef") | head_options(k) | dict(k["params"])
    call = calling(pf.linear_policy_loss, "hidden weight labels old_logprobs advantages mask", **loss, **truncation)
    if k.get("packed"):
        call = packed(call, ("hidden", "labels", "old_logprobs", "advantages", "mask", "weights", "ref_logprobs"))
    return Built(inputs, {"labels": labels, "mask": mask}, call, **head_bounds(spec, k, inputs, logprobs=False))


def packed(call: Callable[[dict], tuple], tokens: tuple[str, ...]) -> Callable[[dict], tuple]:
    """``call`` on the packed layout (``cu_seqlens``): each row's tokens up to its last valid one (the rest,
    masked, changes no result), the ``tokens`` tensors ``[N, ...]``; gradients reach the padded inputs."""

    def run(t: dict) -> tuple:
        valid = t["mask"].flip(-1).cumsum(-1).flip(-1) > 0
        lengths = valid.sum(-1)
        cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        return call(
            {n: x[valid] if n in tokens and x is not None else x for n, x in t.items()} | {"cu_seqlens": cu_seqlens}
        )

    return run


def build_value_loss(spec, gen, k):
    mask = mask_of(gen, spec.dims, spec)
    values, old, returns = (rounded(normal(gen, spec.dims), spec) for _ in range(3))
    old = {"old_values": rounded(values + (old - values) * k["spread"], spec)} if k["old_values"] else {}
    inputs = masked_by(mask, values=values, returns=returns, **old)  # not read without clipping: no gradient either
    call = calling(pf.value_loss, "values old_values returns mask", **named(k, "clip", "agg"))
    return Built(inputs, {"mask": mask}, call)


def build_group_advantages(spec, gen, k):
    B, T = spec.dims
    mask = mask_of(gen, (B, T), spec)
    scores = normal(gen, (B, T) if k["token_scores"] else (B,)) * k["scale"]
    if k["ties"]:  # equal scores in a group: a std of 0
        scores = scores.round()
    inputs = {"scores": Input(rounded(scores, spec), masked=~mask if k["token_scores"] else ~mask.any(-1))}
    if "baselines" in ADVANTAGE_METHODS[k["method"]].params:
        inputs["baselines"] = Input(rounded(normal(gen, B), spec), grad=False, layout="contiguous")
    ids = torch.randint(0, k["groups"], (B,), generator=gen) * 7 - 3
    if spec.layout == "expanded":  # equal rows in a group are ties (the ties knob): each row a group of its own
        ids = torch.arange(B)
    call = calling(pf.group_advantages, "scores group_ids mask", method=k["method"], **dict(k["params"]))
    return Built(inputs, {"mask": mask, "group_ids": ids}, call, (0,), {0: ~mask})


def build_rollout_correction_weights(spec, gen, k):
    mask = mask_of(gen, spec.dims, spec)
    old, rollout = _pair(gen, spec, k, spec.dims)
    options = named(k, "mode", "threshold", "threshold_low", "batch_normalize")
    call = calling(pf.rollout_correction_weights, "old_logprobs rollout_logprobs mask", **options)
    inputs = masked_by(mask, False, old_logprobs=old, rollout_logprobs=rollout)
    return Built(inputs, {"mask": mask}, call, (), {0: ~mask})


def build_masked_stats(spec, gen, k):
    mask = mask_of(gen, spec.dims, spec)
    x = rounded(normal(gen, spec.dims) * k["scale"] + k["offset"], spec)
    whiten = k["fn"] == "whiten"
    fn, options = (pf.masked_whiten, named(k, "shift_mean", "eps")) if whiten else (pf.masked_mean, named(k, "dim"))
    call = calling(fn, "x mask", **options)
    return Built(masked_by(mask, x=x), {"mask": mask}, call, (0,), {0: ~mask} if whiten else {})


def interpreted_triton(backend: str) -> bool:
    """Whether ``backend`` runs Triton kernels on the CPU, through the interpreter."""
    return backend == "triton" and not torch.cuda.is_available()


def without_interpreter_bf16_subnormals(built: Built, spec: Spec) -> Built:
    """The input filter for the Triton interpreter's bfloat16 subnormal bug: triton 3.8's interpreter
    converts a bfloat16 subnormal to float32 as 0 (``tools/triton_interpreter_bf16_subnormal.py``, the
    upstream reproducer; on a GPU the conversion is exact), so an interpreted bfloat16 case with such an
    input could pass or fail on that artifact alone (a row's maximum dropped by top_k, say).  For those
    cases each float input whose bfloat16 value is subnormal is set to a signed 0, for every run of the
    case (the reference and float64 included); every other case is left as it is."""
    if not (interpreted_triton(spec.backend) and spec.dtype == "bfloat16"):
        return built
    tiny = torch.finfo(torch.bfloat16).tiny
    for inp in built.inputs.values():
        subnormal = (inp.values != 0) & (inp.values.to(torch.bfloat16).double().abs() < tiny)
        inp.values = torch.where(subnormal, inp.values * 0.0, inp.values)
    return built


def poisoned(built: Built, spec: Spec, gen) -> dict[str, torch.Tensor]:
    """The float inputs' values with the spec's poison: NaN/+-inf at masked positions, or one
    NaN/+-inf at a valid position of one input (of its first row, for an expanded one); expanded
    inputs repeat their first row."""
    out = {}
    names = list(built.inputs)
    for name, inp in built.inputs.items():
        x = inp.values.clone()
        expanded = spec.layout == "expanded" and inp.layout is None and x.dim() and x.shape[0]
        if spec.poison == "masked" and inp.masked is not None:
            junk = torch.tensor([math.nan, math.inf, -math.inf], dtype=F64)[torch.randint(0, 3, x.shape, generator=gen)]
            x = torch.where(inp.masked, junk, x)
        elif spec.poison.startswith("valid") and name == names[spec.poison_input % len(names)]:
            read = ~inp.masked if inp.masked is not None else torch.ones_like(x, dtype=torch.bool)
            valid = read.flatten().nonzero()
            valid = valid[valid < x[:1].numel()] if expanded else valid
            if len(valid):
                x.view(-1)[valid[torch.randint(0, len(valid), (1,), generator=gen)]] = float(spec.poison.split()[1])
        if expanded:
            x = x[:1].expand_as(x).clone()
        out[name] = x
    return out


@dataclasses.dataclass
class Run:
    error: BaseException | None = None
    outputs: list = dataclasses.field(default_factory=list)
    requires_grad: list = dataclasses.field(default_factory=list)
    grads: dict = dataclasses.field(default_factory=dict)  # leaf name -> gradient in the leaf's layout (None: none)
    views: dict = dataclasses.field(default_factory=dict)  # leaf name -> leaf gradient to the input's shape
    second: dict | None = None  # leaf name -> second-order gradient
    second_error: BaseException | None = None
    projection: tuple | None = None


def tensors_of(built: Built, spec: Spec, values: dict, dtype) -> tuple[dict, dict, dict]:
    """``(tensors, leaves, views)``: the op's arguments on the spec's device in its layout (the float
    inputs ``values`` in ``dtype``), the leaves that take gradients and each leaf's map to its input."""
    tensors, leaves, views = {}, {}, {}
    for name, inp in built.inputs.items():
        leaf, view_of = laid_out(values[name].to(spec.device, dtype), inp.layout or spec.layout)
        if inp.grad:
            leaves[name], views[name] = leaf.requires_grad_(True), view_of
        tensors[name] = view_of(leaf)
    for name, t in built.others.items():
        flat = spec.layout == "expanded" and t.dim() < 2  # one group id, or one row's mask, for all
        leaf, view_of = laid_out(t.to(spec.device), "contiguous" if flat else spec.layout)
        tensors[name] = view_of(leaf)
    return tensors, leaves, views


def run(built, spec, values, backend, dtype, projection=None, *, compiled=None, second_order=False, raises=False):
    """The op on ``backend`` on ``values`` in ``dtype`` and the spec's layout, and the gradients
    of ``sum(w * out)`` over the outputs where ``finite``: ``projection = (finite, w)``, by
    default this run's finite outputs and random weights times the ``cotangent`` knob (the
    reference's, for the others).
    The op's error is the Run's (to compare with the reference's), or raised with ``raises``."""
    tensors, leaves, views = tensors_of(built, spec, values, dtype)
    result, fn = Run(views=views), built.call
    if compiled is not None:
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=compiled)
    try:
        with pf.use_backend(backend):
            outputs = fn(tensors)
    except Exception as err:
        if raises:
            raise
        return Run(error=err)
    result.outputs = [o.detach() for o in outputs]
    result.requires_grad = [o.requires_grad for o in outputs]
    if projection is None:
        wgen = torch.Generator().manual_seed(spec.seed + 1)
        scale = spec.knobs.get("cotangent", 1.0)  # a small one: a gradient near its dtype's underflow
        weights = [(torch.randn(o.shape, generator=wgen) * scale).to(o.device) for o in result.outputs]
        projection = [torch.isfinite(o) for o in result.outputs], weights
    result.projection = finite, weights = projection
    total = sum(
        (torch.where(finite[i], outputs[i], 0.0) * weights[i].to(outputs[i].dtype)).sum() for i in built.differentiable
    )
    result.grads = result.second = dict.fromkeys(leaves)
    if not leaves or not isinstance(total, torch.Tensor) or not total.requires_grad:
        return result
    xs = list(leaves.values())
    result.grads = dict(zip(leaves, torch.autograd.grad(total, xs, allow_unused=True, retain_graph=second_order)))
    if second_order:  # d/dx of sum(v * d total/dx): raising is fine, silent zeros are not
        try:
            grads = torch.autograd.grad(total, xs, allow_unused=True, create_graph=True)
            gen = torch.Generator().manual_seed(spec.seed + 2)
            live = [g for g in grads if g is not None and g.requires_grad]
            s = sum((g * torch.randn(g.shape, generator=gen).to(g)).sum() for g in live)
            second = torch.autograd.grad(s, xs, allow_unused=True) if live else [None] * len(leaves)
            result.second = dict(zip(leaves, second))
        except (RuntimeError, NotImplementedError) as err:
            result.second_error = err
    return result


# --------------------------------------------------------------------------- against a peer's own function


def assert_same_results(got, want, wrt=None, **tol) -> None:
    """Two calls' results alike (ours, a peer's): their tensors with the same dtypes and equal within
    ``tol`` (default 1e-5, compared in float64), None in the same places, and the same gradients with
    respect to ``wrt`` of their tensors' sum, output i weighted 1 / (i + 1) so that swapped ones show."""
    tol = {"atol": 1e-5, "rtol": 1e-5, **tol}
    results = [[r] if r is None or torch.is_tensor(r) else list(r) for r in (got, want)]
    if wrt is not None:
        for r in results:
            r += torch.autograd.grad(sum(t.sum() / (i + 1) for i, t in enumerate(r) if torch.is_tensor(t)), wrt)
    for g, w in zip(*results, strict=True):
        assert (g is None) == (w is None), (g, w)
        if torch.is_tensor(w):
            assert g.dtype == w.dtype, (g.dtype, w.dtype)
            torch.testing.assert_close(g.double(), w.double(), **tol)
