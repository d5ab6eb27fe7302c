"""``python -m bench head_plans``: the GEMM-first fused head's memory plans on a GPU, against cuBLAS and
Liger's fused GRPO loss, at issue 49's shape by default (N=16384 tokens in sequences of 512, H=4096,
V=151936, bf16, 30% of the log-probs' rows ignored).

- ``linear``: the plain linear layer ``hidden @ weight.T`` (cuBLAS), forward and forward + backward
  (autograd's two products), the yardstick of every ratio;
- ``logprobs``: ``linear_token_logprobs``' GEMM-first forward and backward (``_gemm_head``) under each
  plan of ``head_tiles.GEMM_PLANS`` (384 rows and bf16 ``d_weight``, what the default budget picks
  truncated; 512 rows; 2048 rows and a float32 accumulator, the former plan; the 2-D plan untruncated
  calls take, and its rows by an L2-sized slice), log-probs checked against the first;
- ``loss``: ``pf.linear_policy_loss`` (vanilla, token-mean, clip 0.2) forward + backward under each
  budget of ``BUDGETS`` (``_head_plan.MEMORY_BUDGET``), the plan it chose, its loss and gradients
  compared with the default budget's; then the same tokens packed (``cu_seqlens``) under the default
  budget, as token-slice chunks (the padded batch's 512-token sequences are run as that packed layout
  too, ``_head_plan.token_slices``: both take the plan's paired chunks), each row saying whether the call
  paired its ``d_weight`` products (``Gradients.pair``, seen as it ran);
- ``liger-grpo``: Liger-Kernel's ``LigerFusedLinearGRPOLoss`` on the same batch (``loss_type="bnpo"``, a
  token mean over the batch, ``beta=0``: the same loss), its loss and gradients compared with ours.
  Liger-Kernel is a CUDA package: elsewhere the row says it was skipped and why, never a number.

Each row: eager wall time per call (``bench.timing``: warmed, median and IQR over blocks, synchronised)
and on CUDA the peak memory beyond the inputs.  Every row is written as it is measured, so a run cut
short keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch

import ppo_fast as pf

from .common import result_header, write_json
from .head_tiles import GEMM_PLANS, OPTIONS, _head, as_plan, measure_gemm
from .timing import peak_extra_bytes, time_cpu, time_cuda

BUDGETS = (None, 1.0)  # the default (5% of the logits' bytes) and one that holds 2048 rows and float32
CLIP = 0.2


def _timed(fn, rep_ms: int, device: torch.device) -> dict:
    """``fn``'s eager wall time (median and IQR, ms) and, on CUDA, its peak memory beyond its inputs."""
    if device.type == "cuda":
        timing = time_cuda(fn, use_graph=False, rep_ms=rep_ms)[0]
        out = {"peak_extra_bytes": peak_extra_bytes(fn, "cuda")}
    else:
        timing, out = time_cpu(fn, rep_ms / 1e3), {}
    return {"ms": timing.median_ms, "iqr_ms": [timing.q25_ms, timing.q75_ms], "timer": timing.timer, **out}


def loss_batch(rows: int, length: int, hidden: int, vocab: int, device: torch.device, seed: int = 0) -> dict:
    """A GRPO batch: ``rows // length`` sequences, hidden states and head bf16, one advantage a sequence,
    old log-probs near the policy's (ratios about 1), 90% of the tokens in the mask."""
    gen = torch.Generator().manual_seed(seed)
    batch = max(1, rows // length)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # bf16 is wrong in the interpreter
    adv = torch.randn(batch, generator=gen)
    x = {
        "hidden": torch.randn(batch, length, hidden, generator=gen).to(dtype),
        "weight": (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(dtype),
        "labels": torch.randint(0, vocab, (batch, length), generator=gen),
        "mask": torch.rand(batch, length, generator=gen) < 0.9,
        "adv_seq": adv,
        "adv": adv[:, None].expand(batch, length).contiguous(),
    }
    x = {k: v.to(device) for k, v in x.items()}
    with torch.no_grad(), pf.use_backend("triton"):  # old log-probs: the policy's own, moved a little
        x["old"] = pf.linear_token_logprobs(
            x["hidden"], x["weight"], x["labels"], temperature=OPTIONS["temperature"]
        ).float() + 0.05 * torch.randn(batch, length, generator=gen).to(device)
    return x


def _ours(x: dict, packed: bool = False):
    """Our one pass on ``x``; ``packed``: the same tokens as one packed row (``cu_seqlens``), whose chunks
    are token slices (the padded batch's too where its sequences are longer than ``_head_plan.ROW_STEP``,
    run as the packed layout; whole sequences otherwise)."""
    batch, length = x["labels"].shape
    flat = {k: x[k].reshape(batch * length, *x[k].shape[2:]) for k in ("hidden", "labels", "old", "adv", "mask")}
    ends = torch.arange(0, batch * length + 1, length, dtype=torch.int32, device=x["labels"].device)
    layout = {"cu_seqlens": ends, "max_seqlen": length} if packed else {}
    y = flat if packed else x

    def run():
        h, w = y["hidden"].detach().requires_grad_(), x["weight"].detach().requires_grad_()
        with pf.use_backend("triton"):  # the GEMM-first one pass (auto's choice on CUDA)
            loss, _ = pf.linear_policy_loss(
                h,
                w,
                y["labels"],
                y["old"],
                y["adv"],
                y["mask"],
                loss_mode="vanilla",
                agg="token-mean",
                temperature=OPTIONS["temperature"],
                clip_eps_low=CLIP,
                **layout,
            )
        loss.backward()
        return loss.detach(), h.grad.reshape(x["hidden"].shape), w.grad

    return run


def liger_grpo(x: dict, compiled: bool):
    """Liger's fused GRPO loss on ``x`` (fwd + bwd), or raises why it cannot run here."""
    if x["hidden"].device.type != "cuda":
        raise RuntimeError("skipped: Liger-Kernel is a CUDA package (the GPU check times it); no CUDA device here")
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    fn = LigerFusedLinearGRPOLoss(
        beta=0.0,
        compiled=compiled,
        use_ref_model=False,
        epsilon_low=CLIP,
        epsilon_high=CLIP,
        loss_type="bnpo",
        temperature=OPTIONS["temperature"],
    )

    def run():
        h, w = x["hidden"].detach().requires_grad_(), x["weight"].detach().requires_grad_()
        out = fn(h, w, x["labels"], x["mask"].to(torch.int64), x["adv_seq"], old_per_token_logps=x["old"])
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        return loss.detach(), h.grad, w.grad

    return run


def _compared(got, want) -> dict:
    """The loss's absolute difference, and each gradient's largest difference over its largest entry."""
    diff = {"loss_abs_diff": float((got[0].float() - want[0].float()).abs())}
    for name, g, w in zip(("d_hidden", "d_weight"), got[1:], want[1:]):
        diff[f"{name}_max_rel_diff"] = float(
            (g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30)
        )
    return diff


@contextlib.contextmanager
def _budget(value):
    from ppo_fast.backends import _head_plan

    saved = _head_plan.MEMORY_BUDGET
    _head_plan.MEMORY_BUDGET = saved if value is None else value
    try:
        yield _head_plan
    finally:
        _head_plan.MEMORY_BUDGET = saved


@contextlib.contextmanager
def _pairing(seen: list):
    """Within the block, whether each one-pass call's ``d_weight`` products were paired (``Gradients.pair``,
    as the call decided it) is appended to ``seen``."""
    from ppo_fast.backends.triton import _gemm_head

    gradients = _gemm_head.Gradients

    class Seen(gradients):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(self.pair)

    _gemm_head.Gradients = Seen
    try:
        yield
    finally:
        _gemm_head.Gradients = gradients


def measure_loss(x: dict, args, device, result: dict) -> None:
    """The one pass under each budget, then Liger's GRPO loss, into ``result["loss"]`` as they come."""
    want = None
    for budget, packed in [(b, False) for b in BUDGETS] + [(None, True)]:
        with _budget(budget) as plan:
            from ppo_fast.backends.triton._gemm_head import head_plan

            chosen = head_plan("loss", x["hidden"].reshape(-1, x["hidden"].shape[-1]), x["weight"])
            row = {"impl": "ppo_fast one pass", "budget": plan.MEMORY_BUDGET, "plan": chosen._asdict()}
            row["layout"] = "packed (cu_seqlens)" if packed else "padded"
            try:
                run = _ours(x, packed)
                with _pairing(seen := []):
                    got = run()
                row["paired"] = any(seen)  # what the call did, not what the plan asked
                want = want or got
                row.update(_compared(got, want), **_timed(run, args.rep_ms, device))
            except Exception as err:  # reported, the rest go on
                row["error"] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        result["loss"].append(row)
        print(f"  loss, budget {row['budget']}: {row}", flush=True)
        write_json(args.out, result)
    row = {"impl": "liger-grpo", "compiled": args.liger_compiled}
    try:
        run = liger_grpo(x, args.liger_compiled)
        got = run()
        row.update((_compared(got, want) if want else {}), **_timed(run, args.rep_ms, device))
    except Exception as err:  # absent, CUDA-only or broken: the reason, never a number
        row["skipped" if "skipped" in str(err) or isinstance(err, ImportError) else "error"] = (
            f"{type(err).__name__}: {err}".splitlines()[0][:300]
        )
    result["loss"].append(row)
    print(f"  {row}", flush=True)
    write_json(args.out, result)


def measure_linear(head, rep_ms: int, device) -> dict:
    """The plain linear layer (cuBLAS): its forward, and forward + backward with a random cotangent."""
    h, w = head[0].detach().requires_grad_(), head[1].detach().requires_grad_()
    grad = torch.randn(h.shape[0], w.shape[0], device=device, dtype=h.dtype)
    fwd = _timed(lambda: h.detach() @ w.detach().T, rep_ms, device)
    both = _timed(lambda: torch.autograd.grad(torch.nn.functional.linear(h, w), (h, w), grad), rep_ms, device)
    return {"fwd": fwd, "fwd_bwd": both}


def measure_logprobs(head, args, result: dict) -> None:
    """linear_token_logprobs' GEMM-first passes under each plan, log-probs checked against the first's."""
    from ppo_fast._sampling import NO_TRUNCATION
    from ppo_fast.backends.triton import _gemm_head as gemm

    c = gemm.constants(OPTIONS["temperature"], OPTIONS["logit_scale"], OPTIONS["logit_softcap"])
    want = None
    for plan in GEMM_PLANS:
        row = measure_gemm(plan, head, args.rep_ms, want)
        if want is None and "error" not in row:
            options = dict(ignore_index=-100, return_entropy=True, truncation=NO_TRUNCATION, plan=as_plan(plan))
            want = gemm.forward(*head, None, c, **options)[0]
        result["logprobs"].append(row)
        print(f"  log-probs, plan {plan}: {row}", flush=True)
        write_json(args.out, result)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench head_plans", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--length", type=int, default=512, help="tokens a sequence (the loss's batch)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rep-ms", type=int, default=300, help="milliseconds of calls timed per row")
    parser.add_argument("--liger-compiled", action="store_true", help="Liger's torch.compile'd chunks (its default)")
    parser.add_argument("--out", default="bench_out/head_plans.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error(
            "head_plans times Triton's compiled kernels: it needs a CUDA device (or, to try it, the interpreter)"
        )
    shape = {"rows": args.rows, "length": args.length, "hidden": args.hidden, "vocab": args.vocab}
    result = {**result_header("head_plans", argv, device), "shape": shape, "linear": {}, "logprobs": [], "loss": []}
    head = _head(args.rows, args.hidden, args.vocab, device)
    result["linear"] = measure_linear(head, args.rep_ms, device)
    print(f"  linear layer (cuBLAS): {result['linear']}", flush=True)
    write_json(args.out, result)
    measure_logprobs(head, args, result)
    del head
    measure_loss(loss_batch(args.rows, args.length, args.hidden, args.vocab, device), args, device, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
