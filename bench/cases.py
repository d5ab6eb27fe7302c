"""The benchmark cases: per op, its shapes, inputs, the public call, the baselines and the bytes it must move.

Our implementations are not listed here: every backend that ``ppo_fast.backends``
reports available for the device is measured through the public op under
``pf.use_backend(name)`` (see ``bench.runner``), so a new backend shows up by itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import ppo_fast as pf

from . import baselines

OPS = ("token_logprobs", "linear_token_logprobs", "gae", "kl_penalized_rewards", "clipped_policy_loss", "value_loss")

TEMPERATURE = 0.7
MASKED_ROW_FRACTION = 0.3
GAMMA, LAM = 1.0, 0.95
KL_COEF, KL_ESTIMATOR = 0.05, "k3"
CLIP_EPS, DUAL_CLIP, VALUE_CLIP, AGG = 0.2, 3.0, 0.2, "token-mean"


@dataclass
class Case:
    op: str
    shape: str  # human label, e.g. "N=4096 V=32000 bf16"
    size: int  # x axis of the plots: elements of the main input
    make_inputs: Callable[[torch.device], dict]
    call_op: Callable[[dict], object]  # the public op with this case's hyper-parameters
    baselines: dict[str, Callable[[dict], object]]
    eager_baseline: str  # the name in ``baselines`` that speedups are relative to
    # Functions torch.compile is applied to (same call convention as baselines).
    compile_targets: dict[str, Callable[[dict], object]]
    fwd_bytes: int  # bytes a forward must read and write at least
    bwd_bytes: int = 0  # extra bytes of the backward; 0 when not differentiable
    grad_input: str | None = None  # input differentiated in the fwd+bwd mode
    params: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # Baselines that compute something else (time yardsticks): timed, not compared.
    yardsticks: tuple[str, ...] = ()
    # Useful floating-point operations per mode (the head's own products), for TFLOP/s.
    flops: dict[str, int] = field(default_factory=dict)

    @property
    def modes(self) -> tuple[str, ...]:
        return ("fwd", "fwd+bwd") if self.grad_input else ("fwd",)


def primary_output(out) -> torch.Tensor:
    """The tensor compared against the reference: the op's first output."""
    return out[0] if isinstance(out, (tuple, list)) else out


# --------------------------------------------------------------------------- inputs


def _right_padded_mask(batch: int, length: int, device: torch.device) -> torch.Tensor:
    """Responses of random length in [length/4, length], padded on the right."""
    lengths = torch.randint(max(1, length // 4), length + 1, (batch, 1), device=device)
    return torch.arange(length, device=device) < lengths


def rows_read(n: int) -> int:
    """The rows a kernel reads: the others' labels are ignore_index (exactly MASKED_ROW_FRACTION of them)."""
    return n - round(n * MASKED_ROW_FRACTION)


def _labels(n: int, vocab: int, device: torch.device) -> torch.Tensor:
    labels = torch.randint(0, vocab, (n,), device=device)
    labels[torch.randperm(n, device=device)[rows_read(n) :]] = baselines.IGNORE_INDEX
    return labels


def _logprob_inputs(n: int, vocab: int, dtype: torch.dtype, device: torch.device) -> dict:
    logits = torch.randn(n, vocab, dtype=dtype, device=device)
    labels = _labels(n, vocab, device)
    return {"logits": logits, "labels": labels, "grad_out": torch.randn(n, device=device)}


def _sequence_inputs(batch: int, length: int, device: torch.device) -> dict:
    mask = _right_padded_mask(batch, length, device)
    logprobs = -torch.rand(batch, length, device=device) * 5
    return {
        "mask": mask,
        "scores": torch.randn(batch, device=device),
        "logprobs": logprobs,
        "ref_logprobs": logprobs + 0.1 * torch.randn_like(logprobs),
        "old_logprobs": logprobs + 0.1 * torch.randn_like(logprobs),
        "advantages": torch.randn(batch, length, device=device),
        "rewards": torch.randn(batch, length, device=device) * mask,
        "values": torch.randn(batch, length, device=device),
        "old_values": torch.randn(batch, length, device=device),
        "returns": torch.randn(batch, length, device=device),
    }


# --------------------------------------------------------------------------- cases


def truncation_label(truncation: dict | None) -> str:
    """The shape label's suffix of a sampling-truncated row, e.g. " top_k=50"."""
    return "".join(f" {name}={value}" for name, value in (truncation or {}).items())


def _truncated(case: Case, truncation: dict | None) -> Case:
    """``case`` as a row of the sampling-truncated op: no baseline computes that distribution, so
    only our backends are timed (against the plain row of the same shape)."""
    if not truncation:
        return case
    case.baselines, case.eager_baseline, case.compile_targets = {}, None, {}
    case.params["truncation"] = dict(truncation)
    case.notes.append("sampling-truncated: our backends only (no baseline computes the truncated distribution)")
    return case


def logprob_case(n: int, vocab: int, dtype: torch.dtype, truncation: dict | None = None) -> Case:
    elt = torch.tensor([], dtype=dtype).element_size()
    row_bytes = vocab * elt
    per_row = 8 + 4  # label in, log-prob out
    truncation_kwargs = truncation or {}

    def eager(x):
        return baselines.eager_logprobs(x["logits"], x["labels"], TEMPERATURE)

    case = Case(
        op="token_logprobs",
        shape=f"N={n} V={vocab} {str(dtype).replace('torch.', '')}{truncation_label(truncation)}",
        size=n * vocab,
        make_inputs=lambda device: _logprob_inputs(n, vocab, dtype, device),
        call_op=lambda x: pf.token_logprobs(x["logits"], x["labels"], temperature=TEMPERATURE, **truncation_kwargs),
        baselines={
            "eager": eager,
            **baselines.trl_logprob_baseline(
                TEMPERATURE, dtype
            ),  # TRL's own selective_log_softmax where installed, else trl-chunked
        },
        eager_baseline="eager",
        # The reference's own row-chunk loop would be unrolled by dynamo (N·V / 2^24 chunks,
        # a thousand at the largest shape); the same math unchunked is what gets compiled.
        compile_targets={"compile(eager)": eager},
        # The forward reads the logits of the rows it scores once (an ignored row's never); the
        # backward reads them again and writes the whole gradient (zeros in the ignored rows).
        fwd_bytes=rows_read(n) * row_bytes + n * per_row,
        bwd_bytes=rows_read(n) * row_bytes + n * row_bytes + n * (8 + 4),
        grad_input="logits",
        params={
            "dtype": str(dtype).replace("torch.", ""),
            "temperature": TEMPERATURE,
            "masked_rows": MASKED_ROW_FRACTION,
            "return_entropy": False,
        },
    )
    return _truncated(case, truncation)


def _head_inputs(n: int, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device) -> dict:
    # Logits of unit scale, as a trained head gives; the head always collects its gradient.
    weight = (torch.randn(vocab, hidden, device=device) / hidden**0.5).to(dtype).requires_grad_(True)
    labels = _labels(n, vocab, device)
    return {
        "hidden": torch.randn(n, hidden, device=device, dtype=dtype),
        "weight": weight,
        "labels": labels,
        "grad_out": torch.randn(n, device=device),
    }


def _fresh_head_grad(fn: Callable[[dict], object]) -> Callable[[dict], object]:
    """``fn`` with the head's gradient reset first (the runner resets only ``grad_input``'s)."""

    def run(x):
        x["weight"].grad = None
        return fn(x)

    return run


def linear_logprob_case(n: int, hidden: int, vocab: int, dtype: torch.dtype, truncation: dict | None = None) -> Case:
    elt = torch.tensor([], dtype=dtype).element_size()
    truncation_kwargs = truncation or {}
    product_flops = 2 * n * hidden * vocab

    def eager(x):
        return baselines.eager_linear_logprobs(x["hidden"], x["weight"], x["labels"], TEMPERATURE)

    def matmul_then_ours(x):
        return pf.token_logprobs(x["hidden"] @ x["weight"].T, x["labels"], temperature=TEMPERATURE)

    calls = {
        "eager": eager,
        "matmul+token_logprobs": matmul_then_ours,
        **baselines.trl_fused_head_baseline(TEMPERATURE),
        **baselines.torch_linear_ce_baseline(TEMPERATURE),
        "linear-layer": lambda x: baselines.linear_layer_yardstick(x["hidden"], x["weight"]),
    }
    case = Case(
        op="linear_token_logprobs",
        shape=f"N={n} H={hidden} V={vocab} {str(dtype).replace('torch.', '')}{truncation_label(truncation)}",
        size=n * vocab,
        make_inputs=lambda device: _head_inputs(n, hidden, vocab, dtype, device),
        call_op=_fresh_head_grad(
            lambda x: pf.linear_token_logprobs(
                x["hidden"], x["weight"], x["labels"], temperature=TEMPERATURE, **truncation_kwargs
            )
        ),
        baselines={name: _fresh_head_grad(fn) for name, fn in calls.items()},
        eager_baseline="eager",
        compile_targets={},
        # the scored rows' hidden states and the head in, log-probs out; the backward reads them
        # again and writes both gradients (d_hidden whole: zeros in the ignored rows)
        fwd_bytes=(rows_read(n) + vocab) * hidden * elt + n * 12,
        bwd_bytes=(rows_read(n) + vocab) * hidden * elt + (n + vocab) * hidden * elt + n * 12,
        grad_input="hidden",
        params={
            "dtype": str(dtype).replace("torch.", ""),
            "temperature": TEMPERATURE,
            "masked_rows": MASKED_ROW_FRACTION,
            "logits_bytes_fp32": 4 * n * vocab,
            "gradients": "hidden and weight",
        },
        notes=[
            "linear-layer: the head's own products only (a yardstick, not compared); "
            "fused heads recompute the logits in the backward (four products against its three)"
        ],
        yardsticks=("linear-layer",),
        flops={"fwd": product_flops, "fwd+bwd": 3 * product_flops},
    )
    return _truncated(case, truncation)


def gae_case(batch: int, length: int) -> Case:
    tokens = batch * length
    return Case(
        op="gae",
        shape=f"B={batch} T={length}",
        size=tokens,
        make_inputs=lambda device: _sequence_inputs(batch, length, device),
        call_op=lambda x: pf.gae(x["rewards"], x["values"], x["mask"], gamma=GAMMA, lam=LAM),
        baselines={"python-loop": lambda x: baselines.loop_gae(x["rewards"], x["values"], x["mask"], GAMMA, LAM)},
        eager_baseline="python-loop",
        compile_targets={},
        fwd_bytes=tokens * (4 + 4 + 1 + 4 + 4),  # rewards, values, mask in; advantages, returns out
        params={"gamma": GAMMA, "lam": LAM},
        notes=["torch.compile not measured: it unrolls the T-step loop (one graph node per token)"],
    )


def kl_rewards_case(batch: int, length: int) -> Case:
    tokens = batch * length

    def eager(x):
        return baselines.eager_kl_rewards(x["scores"], x["logprobs"], x["ref_logprobs"], x["mask"], KL_COEF)

    return Case(
        op="kl_penalized_rewards",
        shape=f"B={batch} T={length}",
        size=tokens,
        make_inputs=lambda device: _sequence_inputs(batch, length, device),
        call_op=lambda x: pf.kl_penalized_rewards(
            x["scores"], x["logprobs"], x["ref_logprobs"], x["mask"], kl_coef=KL_COEF, kl_estimator=KL_ESTIMATOR
        ),
        baselines={"eager": eager},
        eager_baseline="eager",
        compile_targets={"compile(eager)": eager},
        fwd_bytes=tokens * (4 + 4 + 1 + 4 + 4) + batch * 4,  # logp, ref, mask in; rewards, kl out; scores
        params={"kl_coef": KL_COEF, "kl_estimator": KL_ESTIMATOR},
    )


def policy_loss_case(batch: int, length: int) -> Case:
    tokens = batch * length

    def eager(x):
        return baselines.eager_policy_loss(
            x["logprobs"],
            x["old_logprobs"],
            x["advantages"],
            x["mask"],
            clip_eps=CLIP_EPS,
            dual_clip=DUAL_CLIP,
            agg=AGG,
        )

    return Case(
        op="clipped_policy_loss",
        shape=f"N={tokens} (B={batch} T={length})",
        size=tokens,
        make_inputs=lambda device: _sequence_inputs(batch, length, device),
        call_op=lambda x: pf.clipped_policy_loss(
            x["logprobs"],
            x["old_logprobs"],
            x["advantages"],
            x["mask"],
            clip_eps_low=CLIP_EPS,
            dual_clip=DUAL_CLIP,
            agg=AGG,
        ),
        baselines={"eager": eager},
        eager_baseline="eager",
        compile_targets={"compile(eager)": eager},
        fwd_bytes=tokens * (4 + 4 + 4 + 1),  # logp, old, advantages, mask
        bwd_bytes=tokens * (4 + 4 + 4 + 1 + 4),  # the same inputs again, the gradient out
        grad_input="logprobs",
        params={"clip_eps_low": CLIP_EPS, "dual_clip": DUAL_CLIP, "agg": AGG},
    )


def value_loss_case(batch: int, length: int) -> Case:
    tokens = batch * length

    def eager(x):
        return baselines.eager_value_loss(x["values"], x["old_values"], x["returns"], x["mask"], VALUE_CLIP, AGG)

    return Case(
        op="value_loss",
        shape=f"N={tokens} (B={batch} T={length})",
        size=tokens,
        make_inputs=lambda device: _sequence_inputs(batch, length, device),
        call_op=lambda x: pf.value_loss(
            x["values"], x["old_values"], x["returns"], x["mask"], clip=VALUE_CLIP, agg=AGG
        ),
        baselines={"eager": eager},
        eager_baseline="eager",
        compile_targets={"compile(eager)": eager},
        fwd_bytes=tokens * (4 + 4 + 4 + 1),
        bwd_bytes=tokens * (4 + 4 + 4 + 1 + 4),
        grad_input="values",
        params={"clip": VALUE_CLIP, "agg": AGG},
    )


# --------------------------------------------------------------------------- shape sets

_SEQUENCE_CASES = {"gae": gae_case, "kl_penalized_rewards": kl_rewards_case}
_LOSS_CASES = {"clipped_policy_loss": policy_loss_case, "value_loss": value_loss_case}
# Losses take [B, T]; N tokens are laid out as rows of this many.
_LOSS_ROW = 4096

# The sampling truncations timed next to a plain row (the shape tuples' last element).
TOP_K, TOP_P = {"top_k": 50}, {"top_p": 0.9}

# The GPU shapes.
GPU_SHAPES = {
    "token_logprobs": [(n, v, torch.bfloat16) for n in (4096, 16384, 65536) for v in (32000, 128256, 151936, 262144)]
    + [(16384, 151936, torch.bfloat16, TOP_K), (16384, 151936, torch.bfloat16, TOP_P)],
    # (N, H, V, dtype): a Qwen2.5-0.5B-like and a Llama-3-8B-like head.
    "linear_token_logprobs": [
        (16384, 896, 151936, torch.bfloat16),
        (16384, 896, 151936, torch.bfloat16, TOP_P),
        (8192, 4096, 128256, torch.bfloat16),
    ],
    "sequence": [(256, 1024), (64, 8192), (16, 32768), (1, 32768)],
    "loss_tokens": [16384, 262144, 1 << 20],
}
# CPU: the CPU targets plus a few neighbours that finish in minutes on 2 cores.
CPU_SHAPES = {
    "token_logprobs": [
        *[(2048, 32000, dtype, *t) for dtype in (torch.float32, torch.bfloat16) for t in ((), (TOP_K,), (TOP_P,))],
        (512, 151936, torch.bfloat16),
    ],
    # The last two: float32 logits of 1.07 GB, the CPU goal shape of the fused head.
    "linear_token_logprobs": [
        (1024, 256, 32768, torch.float32),
        (8192, 256, 32768, torch.float32),
        (8192, 256, 32768, torch.float32, TOP_P),
    ],
    "sequence": [(16, 4096), (256, 1024)],
    "loss_tokens": [16384, 262144],
}
CPU_NOTE = (
    "CPU subset of the GPU shapes (full sizes would take hours on a few cores): "
    "token_logprobs [2048, 32000] fp32 and bf16 (plain, top_k=50, top_p=0.9) and [512, 151936] bf16; "
    "linear_token_logprobs N=1024 and 8192 (plain, and top_p=0.9 at 8192), H=256, V=32768 fp32; GAE/KL [16, 4096] and [256, 1024]; "
    "losses 16k and 262k tokens"
)
QUICK_SHAPES = {
    "token_logprobs": [(256, 4096, torch.float32), (256, 4096, torch.bfloat16)],
    "linear_token_logprobs": [(256, 64, 4096, torch.float32)],
    "sequence": [(8, 512)],
    "loss_tokens": [4096],
}


def shape_set(device_type: str, quick: bool) -> tuple[dict, str | None]:
    if quick:
        return QUICK_SHAPES, "--quick: small shapes for a smoke run; timings say little about real sizes"
    if device_type == "cpu":
        return CPU_SHAPES, CPU_NOTE
    return GPU_SHAPES, None


def build_cases(ops: tuple[str, ...], shapes: dict) -> list[Case]:
    """Cases breadth-first (every op's smallest shape first), so a time budget cuts sizes, not ops."""
    per_op = {}
    for op in (op for op in OPS if op in ops):
        if op == "token_logprobs":
            per_op[op] = [logprob_case(*shape) for shape in shapes["token_logprobs"]]
        elif op == "linear_token_logprobs":
            per_op[op] = [linear_logprob_case(*shape) for shape in shapes["linear_token_logprobs"]]
        elif op in _SEQUENCE_CASES:
            per_op[op] = [_SEQUENCE_CASES[op](b, t) for b, t in shapes["sequence"]]
        else:
            per_op[op] = [_LOSS_CASES[op](max(1, n // _LOSS_ROW), min(n, _LOSS_ROW)) for n in shapes["loss_tokens"]]
    ordered = []
    for rank in range(max((len(c) for c in per_op.values()), default=0)):
        ordered += [cases[rank] for cases in per_op.values() if rank < len(cases)]
    return ordered
