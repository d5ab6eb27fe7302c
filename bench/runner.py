"""Measure one case: every available ppo_fast backend and every baseline, each mode.

Before it is timed, each implementation's output is compared with the reference
backend's, so a timing is never reported for a wrong answer: a mismatch, an error or
an out-of-memory is recorded in place of the timing (and ours make ``python -m bench``
exit non-zero, see ``bench.ops``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

import ppo_fast as pf
from ppo_fast.backends import serving

from .baselines import OPTIONAL_HEAD_KERNELS, optional_logprob_kernels
from .cases import TEMPERATURE, Case, primary_output
from .timing import cuda_copy_bandwidth_gbps, peak_extra_bytes, time_device, time_eager

# |ours - reference| <= TOL * (1 + |reference|) on the op's first output.  A baseline is held
# to its inputs' precision where that is coarser (tolerance): a bf16 head's bf16 logits are what
# its users get, not a wrong answer.
TOL = 1e-3
# On a GPU our reference (an oracle, plain PyTorch) is checked but not timed when its first call takes
# longer than this: its timing would spend a lent GPU's minutes on no comparison anyone makes.
REFERENCE_UNTIMED_ABOVE_S = 0.25


@dataclass
class Settings:
    device: torch.device
    compile: bool
    measure_memory: bool
    cpu_min_run_time: float
    cuda_rep_ms: int


def serving_backends(op: str, device_type: str) -> list[str]:
    """Our backends that are available and serve ``op`` on ``device_type``, in registry order."""
    return list(serving(op, device_type))


def _with_backend(name: str, call_op: Callable[[dict], object]) -> Callable[[dict], object]:
    def run(inputs):
        with pf.use_backend(name):
            return call_op(inputs)

    return run


def _with_design(design: str, call_op: Callable[[dict], object]) -> Callable[[dict], object]:
    """``call_op`` on the Triton backend with ``linear_token_logprobs.DESIGN = design``."""
    from ppo_fast.backends.triton import linear_token_logprobs as head

    def run(inputs):
        saved, head.DESIGN = head.DESIGN, design
        try:
            with pf.use_backend("triton"):
                return call_op(inputs)
        finally:
            head.DESIGN = saved

    return run


def implementations(
    case: Case, device_type: str, compile_enabled: bool
) -> tuple[list[tuple[str, str, Callable]], list[str]]:
    """``(name, kind, fn)`` for our backends and the baselines, plus notes on what is left out."""
    impls = [(name, "ppo_fast", _with_backend(name, case.call_op)) for name in serving_backends(case.op, device_type)]
    impls += [(name, "baseline", fn) for name, fn in case.baselines.items()]
    notes = list(case.notes)
    if case.params.get("truncation"):  # the optional kernels compute the untruncated distribution
        return impls, notes
    if case.op == "token_logprobs":
        found, skipped = optional_logprob_kernels(device_type)
        impls += [(name, "baseline", _logits_labels_call(fn)) for name, fn in found.items()]
        notes += [f"{name}: {why}" for name, why in skipped.items()]
    if case.op == "linear_token_logprobs":
        if device_type == "cuda" and "triton" in serving_backends(case.op, device_type):
            # the head's "epilogue" design beside the shipped one, against the same baselines (a GPU decides)
            impls.append(("triton epilogue", "ppo_fast", _with_design("epilogue", case.call_op)))
        found, skipped = optional_logprob_kernels(device_type, OPTIONAL_HEAD_KERNELS)
        impls += [(name, "baseline", _head_call(fn)) for name, fn in found.items()]
        notes += [f"{name}: {why}" for name, why in skipped.items()]
    if compile_enabled:
        # Default settings, as a user would call it: the first shape compiles static, the next
        # recompiles once with symbolic sizes that later shapes reuse (first_call_s shows the cost).
        impls += [(name, "baseline", torch.compile(fn)) for name, fn in case.compile_targets.items()]
        if case.compile_targets:
            notes.append("torch.compile with default settings (automatic dynamic shapes after the first shape)")
    elif case.compile_targets:
        notes.append("torch.compile baselines not measured (off with --quick or --no-compile; --compile turns them on)")
    return impls, notes


def _logits_labels_call(fn):
    return lambda x: fn(x["logits"], x["labels"], TEMPERATURE)


def _head_call(fn):
    def run(x):
        x["weight"].grad = None
        return fn(x["hidden"], x["weight"], x["labels"], TEMPERATURE)

    return run


def _runner(case: Case, fn: Callable, mode: str, inputs: dict) -> Callable[[], object]:
    """A no-argument call of ``fn`` in ``mode``: forward without autograd, or forward + backward."""
    if mode == "fwd":

        def forward():
            with torch.no_grad():
                return fn(inputs)

        return forward
    leaf = inputs[case.grad_input]

    def forward_backward():
        leaf.grad = None
        out = fn(inputs)
        first = primary_output(out)
        first.backward(None if first.dim() == 0 else inputs["grad_out"])
        return out

    return forward_backward


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def tolerance(kind: str, inputs: dict) -> float:
    """The tolerance an implementation is held to: ours TOL; a baseline the machine epsilon of
    its least precise floating input where that is coarser."""
    if kind == "ppo_fast":
        return TOL
    floats = [t.dtype for t in inputs.values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return max([TOL, *(torch.finfo(d).eps for d in floats)])


def _mismatch(out, expected: torch.Tensor, tol: float = TOL) -> tuple[float, bool]:
    got = primary_output(out).detach().double()
    want = expected.double()
    if got.shape != want.shape:
        return float("inf"), True
    err = (got - want).abs()
    bad = ~(err <= tol + tol * want.abs()) & ~(got == want)  # equal infinities are fine
    finite = err[torch.isfinite(err)]
    return (float(finite.max()) if finite.numel() else 0.0), bool(bad.any())


def _gradient_mismatch(got: torch.Tensor | None, want: torch.Tensor) -> tuple[float, bool]:
    """The largest distance of a gradient from the reference's, relative to the reference's largest
    entry, and whether it is over twice the gradient dtype's epsilon (TOL at least): the gradient is
    returned in its input's dtype, so a bf16 one is a rounding of the float32 sums, ours too."""
    if got is None or got.shape != want.shape:
        return float("inf"), True
    scale = want.abs().max().item() or 1.0
    err = (got.double() - want.double()).abs().max().item() / scale
    return err, not err <= 2 * max(TOL, torch.finfo(got.dtype).eps)


def _check(case: Case, name: str, kind: str, out, leaf, *, inputs: dict, expected: tuple) -> dict:
    """The first call's output (and gradient) against the reference's: the row's error fields, and
    its status and detail where they say more than "ok"."""
    if name in case.yardsticks:
        return {"max_abs_err": None}
    tol = tolerance(kind, inputs)
    err, wrong = _mismatch(out, expected[0], tol)
    if wrong:
        detail = f"differs from the reference backend by up to {err:.3g} (tolerance {tol:.3g})"
        return {"max_abs_err": err, "status": "mismatch", "detail": detail}
    checked = {"max_abs_err": err}
    if leaf is not None:
        checked["grad_rel_err"], wrong = _gradient_mismatch(leaf.grad, expected[1])
        if wrong:
            detail = (
                f"its gradient of {case.grad_input} differs from the reference's by up to "
                f"{checked['grad_rel_err']:.3g} of its largest entry"
            )
            return {**checked, "status": "mismatch", "detail": detail}
    if err > TOL:  # passed at its inputs' precision only
        checked["detail"] = f"within its inputs' precision: up to {err:.3g} from the reference"
    return checked


def measure(
    case: Case,
    name: str,
    kind: str,
    fn: Callable,
    *,
    mode: str,
    inputs: dict,
    expected: tuple[torch.Tensor, torch.Tensor | None],
    settings: Settings,
) -> dict:
    """One implementation in one mode: checked against ``expected`` (the reference's first output and,
    forward + backward, its gradient of ``case.grad_input``), then timed and its peak memory measured."""
    device = settings.device
    result = {"impl": name, "kind": kind, "mode": mode, "status": "ok"}
    run = _runner(case, fn, mode, inputs)
    leaf = inputs.get(case.grad_input) if mode != "fwd" else None
    if leaf is not None:
        leaf.requires_grad_(True)
    try:
        start = time.perf_counter()
        out = run()  # first call: compilation, autotuning, the answer to check
        _sync(device)
        result["first_call_s"] = time.perf_counter() - start
        result.update(_check(case, name, kind, out, leaf, inputs=inputs, expected=expected))
        del out
        if result["status"] == "mismatch":
            return result
        if device.type == "cuda" and name == "reference" and result["first_call_s"] > REFERENCE_UNTIMED_ABOVE_S:
            result["status"] = "untimed"
            result["detail"] = f"checked, not timed: the oracle's first call took {result['first_call_s']:.2f} s"
            return result
        if settings.measure_memory:
            if leaf is not None:
                leaf.grad = None  # else the first call's gradient counts as "before" and hides the new one
            result["peak_extra_bytes"] = peak_extra_bytes(run, device.type)
        # Every implementation, ours and the baselines: eager wall time per call (what a user's loop
        # pays) and, on CUDA, device time (graph replay, L2 flushed): bench.timing's one rule.
        timing = time_eager(run, _min_run_time(settings), device.type)
        result.update(asdict(timing))
        device_seconds = None
        if device.type == "cuda":
            device_timing, why = time_device(run, settings.cuda_rep_ms)
            if device_timing is None:
                result["detail"] = "; ".join(filter(None, [result.get("detail"), why]))
            else:
                result.update({f"device_{k}": v for k, v in asdict(device_timing).items() if k != "runs"})
                device_seconds = device_timing.median_ms * 1e-3
        # Throughput is the kernels' (device time on CUDA, where there is one).
        seconds = device_seconds or timing.median_ms * 1e-3
        if mode in case.flops and seconds > 0:
            result["tflops"] = case.flops[mode] / seconds / 1e12
        if device_seconds:
            moved = case.fwd_bytes + (case.bwd_bytes if mode != "fwd" else 0)
            result["gbps"] = moved / device_seconds / 1e9
    except torch.OutOfMemoryError:
        result["status"] = "oom"
    except Exception as err:  # recorded and reported, never hidden; ours fail the run
        result["status"] = "error"
        result["detail"] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    finally:
        if leaf is not None:
            leaf.grad = None
            leaf.requires_grad_(False)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def _min_run_time(settings: Settings) -> float:
    return settings.cuda_rep_ms / 1e3 if settings.device.type == "cuda" else settings.cpu_min_run_time


def run_case(case: Case, settings: Settings, copy_gbps: float | None, log=sys.stderr) -> dict:
    device = settings.device
    record = {
        "op": case.op,
        "shape": case.shape,
        "size": case.size,
        "params": case.params,
        "eager_baseline": case.eager_baseline,
        "yardsticks": list(case.yardsticks),
        "results": [],
    }
    try:
        inputs = case.make_inputs(device)
    except torch.OutOfMemoryError:
        record["skipped"] = "inputs do not fit in memory"
        return record
    impls, record["notes"] = implementations(case, device.type, settings.compile)
    expected, expected_grad = _reference(case, inputs)
    for mode in case.modes:
        rows = []
        want = (expected, expected_grad if mode != "fwd" else None)
        for name, kind, fn in impls:
            row = measure(case, name, kind, fn, mode=mode, inputs=inputs, expected=want, settings=settings)
            rows.append(row)
            print(f"  {case.op} {case.shape} {mode:8s} {name:22s} {_short(row)}", file=log, flush=True)
        baseline = next((r for r in rows if r["impl"] == case.eager_baseline and r["status"] == "ok"), None)
        ours = next(
            (r for r in rows if r["impl"] == "reference" and r["kind"] == "ppo_fast" and r["status"] == "ok"), None
        )
        for row in rows:
            if baseline and row["status"] == "ok":
                row["speedup"] = baseline["median_ms"] / row["median_ms"]
                if "device_median_ms" in baseline and "device_median_ms" in row:
                    row["speedup_device"] = baseline["device_median_ms"] / row["device_median_ms"]
            if ours and row["status"] == "ok":
                row["speedup_vs_reference"] = ours["median_ms"] / row["median_ms"]
            if copy_gbps and "gbps" in row:
                row["copy_fraction"] = row["gbps"] / copy_gbps
        record["results"] += rows
    del inputs, expected, expected_grad, want
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def _reference(case: Case, inputs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference backend's first output and, where the case has a backward, its gradient of
    ``case.grad_input`` in the forward + backward mode: one call for both."""
    with pf.use_backend("reference"):
        if case.grad_input is None:
            with torch.no_grad():
                return primary_output(case.call_op(inputs)).detach(), None
        leaf = inputs[case.grad_input]
        leaf.requires_grad_(True)
        try:
            out = _runner(case, case.call_op, "fwd+bwd", inputs)()
            return primary_output(out).detach(), leaf.grad.detach().clone()
        finally:
            leaf.grad = None
            leaf.requires_grad_(False)


def _short(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['status'].upper()} {row.get('detail', '')}"
    return f"{row['median_ms']:.4g} ms"


def copy_bandwidth(device: torch.device) -> float | None:
    return cuda_copy_bandwidth_gbps() if device.type == "cuda" else None
