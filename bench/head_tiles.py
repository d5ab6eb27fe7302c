"""``python -m bench head_tiles``: the Triton fused head's tile configurations on a GPU, so that the
next change of ``_FORWARD_CONFIG`` / ``_BACKWARD_CONFIG`` is a measured one.  First, the "epilogue"
design's forward (the tile kernel as one grouped GEMM, the row work in its epilogue) at each of
``EPILOGUE_CANDIDATES`` and the GEMM-first 2-D plan it must beat, at this shape and, with
``--also-hidden``, at another hidden size (the question the roofline cannot answer: the efficiency of
Triton's products; ``python -m bench head_model`` says what it must reach).  Then, on one bf16 head
(default N=16384, H=4096, V=151936, 30% of the rows ignored) each candidate ``(BLOCK_N, BLOCK_V,
BLOCK_H, num_warps, num_stages)`` times the forward and the backward (its tile kernel and the cuBLAS
products), against the head's own products (``hidden @ weight.T``, cuBLAS) measured in the same run;
the forward with and without its vocabulary split at a micro-batch's rows; the backward by the size
of its gradient scratch (``GRADIENT_SCRATCH_BYTES``); then the GEMM-first design at a few chunk sizes,
and the faster design (``chosen``: what ``linear_token_logprobs.DESIGN`` should be).  Every
candidate's log-probs are checked against the shipped tile configuration's first.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch

from . import cases
from .common import result_header, write_json
from .timing import peak_extra_bytes, time_cpu, time_cuda

# (BLOCK_N, BLOCK_V, BLOCK_H, num_warps, num_stages); the first is what ships.
CANDIDATES = [
    (128, 128, 32, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (64, 256, 64, 8, 3),
    (128, 64, 64, 4, 4),
]


@contextlib.contextmanager
def _tiles(module, config):
    """The fused head's launches in ``config`` (both passes' tiles, every kernel's stages)."""
    saved = module._FORWARD_CONFIG, module._BACKWARD_CONFIG, module._NUM_STAGES
    block_n, block_v, block_h, warps, stages = config
    tiles = {torch.bfloat16: (block_n, block_v, block_h, warps)}
    module._FORWARD_CONFIG = {**saved[0], **tiles}
    module._BACKWARD_CONFIG = {**saved[1], **tiles}
    module._NUM_STAGES = stages
    try:
        yield
    finally:
        module._FORWARD_CONFIG, module._BACKWARD_CONFIG, module._NUM_STAGES = saved


def _ms(fn, rep_ms: int) -> float:
    """The median milliseconds of ``fn`` over about ``rep_ms`` of calls: ``bench.timing``'s timers
    (``do_bench`` on a GPU; the wall clock elsewhere)."""
    if torch.cuda.is_available():
        return time_cuda(fn, use_graph=False, rep_ms=rep_ms)[0].median_ms
    return time_cpu(fn, rep_ms / 1e3, min_runs=1).median_ms


def _head(rows: int, hidden: int, vocab: int, device: torch.device):
    """The fused-head case's own inputs (``bench.cases``: 30% of the rows ignored), bf16."""
    inputs = cases.linear_logprob_case(rows, hidden, vocab, torch.bfloat16).make_inputs(device)
    return inputs["hidden"], inputs["weight"].detach(), inputs["labels"]


OPTIONS = dict(temperature=0.7, logit_scale=1.0, logit_softcap=None, ignore_index=-100)


def _first_call(forward, row: dict, want: torch.Tensor | None) -> tuple:
    """``forward()``'s outputs; into ``row`` its first call's seconds (the compile, on a GPU) and its
    log-probs' largest difference from ``want``."""
    start = time.perf_counter()
    out = forward()
    if out[0].is_cuda:
        torch.cuda.synchronize()
    row["first_call_s"] = time.perf_counter() - start
    if want is not None:
        row["max_abs_diff"] = (out[0] - want).abs().nan_to_num(0.0).max().item()
    return out


def measure(module, config, head, rep_ms: int, want: torch.Tensor | None) -> dict:
    h, w, labels = head
    row = {"config": list(config)}
    needs = dict(needs_hidden=True, needs_weight=True, needs_bias=False)

    def forward():
        return module.linear_token_logprobs_forward(h, w, labels, None, **OPTIONS, return_entropy=True)

    try:
        with _tiles(module, config):
            logp, entropy, stats = _first_call(forward, row, want)
            row["fwd_ms"] = _ms(forward, rep_ms)
            grad = torch.ones_like(logp)
            backward = lambda: module.linear_token_logprobs_backward(  # noqa: E731
                grad, None, h, w, labels, None, stats=stats, entropy=None, **OPTIONS, **needs
            )
            row["bwd_ms"] = _ms(backward, rep_ms)
    except Exception as err:  # a configuration that does not compile or fit: reported, the rest go on
        row["error"] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    return row


# The "epilogue" forward's candidates: (BLOCK_N, BLOCK_V, BLOCK_H, num_warps, num_stages, group, columns a
# program); the first is what ships (linear_token_logprobs._EPILOGUE_CONFIG, EPILOGUE_LAUNCH, EPILOGUE_COLUMNS).
# Four, each without spills in its sm_90 code with a bias, soft-cap and entropy (checked with bench.static's
# compile; 128 x 256 tiles and 4 warps of 128 x 128 spill): each compiles on its first call (seconds).
EPILOGUE_CANDIDATES = [
    (128, 128, 64, 8, 3, 8, 256),
    (128, 128, 64, 8, 4, 8, 256),
    (128, 128, 64, 8, 3, 16, 256),
    (64, 256, 64, 8, 3, 8, 256),
]


@contextlib.contextmanager
def _epilogue(module, config):
    """The "epilogue" forward's launches in ``config`` (bf16)."""
    saved = module._EPILOGUE_CONFIG, module.EPILOGUE_LAUNCH, module.EPILOGUE_COLUMNS
    module._EPILOGUE_CONFIG = {**saved[0], torch.bfloat16: config[:4]}
    module.EPILOGUE_LAUNCH = module.Launch(stages=config[4], group=config[5])
    module.EPILOGUE_COLUMNS = config[6]
    try:
        yield
    finally:
        module._EPILOGUE_CONFIG, module.EPILOGUE_LAUNCH, module.EPILOGUE_COLUMNS = saved


def measure_epilogue(module, config, head, rep_ms: int, want: torch.Tensor | None) -> dict:
    """The "epilogue" forward in ``config``: its milliseconds (and first call's seconds: the compile), its
    log-probs against ``want``, and on CUDA its peak memory beyond its inputs (the shares' partials)."""
    h, w, labels = head
    row = {"config": list(config)}

    def forward():
        return module.linear_token_logprobs_forward(h, w, labels, None, **OPTIONS, return_entropy=True, grouped=True)

    try:
        with _epilogue(module, config):
            _first_call(forward, row, want)
            row["fwd_ms"] = _ms(forward, rep_ms)
            if h.is_cuda:
                row["fwd_peak_extra_bytes"] = peak_extra_bytes(forward, "cuda")
    except Exception as err:  # a configuration that does not compile or fit: reported, the rest go on
        row["error"] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    return row


def epilogue_against_gemm(module, rows: int, hidden: int, vocab: int, device, rep_ms: int) -> dict:
    """At one shape: the linear layer's product, the GEMM-first 2-D plan (the default design, forward and
    backward) and every epilogue candidate's forward, checked against the 2-D plan's log-probs."""
    from ppo_fast.backends._head_plan import block_plan

    head = _head(rows, hidden, vocab, device)
    products_ms = _ms(lambda: head[0] @ head[1].T, rep_ms)
    default = block_plan(hidden, vocab)
    gemm = measure_gemm(tuple(default), head, rep_ms, None)
    want = _gemm_logp(default, head)
    out = {"shape": {"rows": rows, "hidden": hidden, "vocab": vocab}, "products_ms": products_ms, "gemm_2d": gemm}
    out["epilogue"] = []
    for config in EPILOGUE_CANDIDATES:
        out["epilogue"].append(measure_epilogue(module, config, head, rep_ms, want))
        print(f"  epilogue {config} at {rows}x{hidden}x{vocab}: {out['epilogue'][-1]}", flush=True)
    timed = [r for r in out["epilogue"] if "fwd_ms" in r]
    if timed and "fwd_ms" in gemm:
        best = min(timed, key=lambda r: r["fwd_ms"])
        out["best_epilogue"] = best["config"]
        out["fwd_ms"] = {"epilogue": best["fwd_ms"], "gemm-2d": gemm["fwd_ms"], "linear layer": products_ms}
    print(f"  at {rows}x{hidden}x{vocab}, forward ms: {out.get('fwd_ms')}", flush=True)
    return out


def _gemm_logp(plan, head) -> torch.Tensor:
    from ppo_fast._sampling import NO_TRUNCATION
    from ppo_fast.backends.triton import _gemm_head as gemm

    c = gemm.constants(OPTIONS["temperature"], OPTIONS["logit_scale"], OPTIONS["logit_softcap"])
    options = dict(ignore_index=-100, return_entropy=True, truncation=NO_TRUNCATION, plan=plan)
    return gemm.forward(*head, None, c, **options)[0]


# The GEMM-first design's plans (chunk rows, d_weight accumulator bytes): the row plan of truncated calls
# at 16384 x 4096 x 151936 (384 rows, bf16: _head_plan.LOGPROBS_ROWS), 512 rows, and the former plan; and
# (block rows, slice columns, accumulator bytes): the 2-D plan untruncated calls take there (block_plan),
# and the same rows by 16384 columns, a block whose float32 logits (32 MiB) fit an H100's 50 MB L2: whether
# the row kernel then reads them from L2, which the roofline (HBM bytes only) cannot say, decides the
# forward's predicted 1.112x against its 1.10x goal there (bench/results/head-model.md).
GEMM_PLANS = ((384, 2), (512, 2), (2048, 4), (512, 76032, 2), (512, 16384, 2))


def as_plan(plan: tuple):
    """``(rows, acc)``: a row plan; ``(rows, cols, acc)``: a 2-D plan."""
    from ppo_fast.backends._head_plan import BlockPlan, HeadPlan

    return BlockPlan(*plan) if len(plan) == 3 else HeadPlan(*plan)


def measure_gemm(plan: tuple, head, rep_ms: int, want: torch.Tensor | None) -> dict:
    """The GEMM-first design (``_gemm_head``) with ``plan`` = ``(rows, accumulator bytes)`` or ``(rows, slice
    columns, accumulator bytes)``: forward and backward, and on CUDA each one's peak memory beyond its inputs."""
    from ppo_fast._sampling import NO_TRUNCATION
    from ppo_fast.backends.triton import _gemm_head as gemm

    h, w, labels = head
    c = gemm.constants(OPTIONS["temperature"], OPTIONS["logit_scale"], OPTIONS["logit_softcap"])
    chosen = as_plan(plan)
    row = {"chunk_rows": chosen.rows, "d_weight_accumulator": "float32" if chosen.acc == 4 else "bf16"}
    if len(plan) == 3:
        row["slice_columns"] = chosen.cols

    def forward():
        return gemm.forward(
            h, w, labels, None, c, ignore_index=-100, return_entropy=True, truncation=NO_TRUNCATION, plan=chosen
        )

    try:
        logp, entropy, stats, _ = forward()
        if want is not None:
            row["max_abs_diff"] = (logp - want).abs().nan_to_num(0.0).max().item()
        row["fwd_ms"] = _ms(forward, rep_ms)
        grads, saved, needs = (torch.ones_like(logp), None), (stats, None, None), (True, True, False)

        def backward():
            return gemm.backward(grads, h, w, labels, None, c, saved=saved, ignore_index=-100, needs=needs, plan=chosen)

        row["bwd_ms"] = _ms(backward, rep_ms)
        if h.is_cuda:
            row["fwd_peak_extra_bytes"] = peak_extra_bytes(forward, "cuda")
            row["bwd_peak_extra_bytes"] = peak_extra_bytes(backward, "cuda")
    except Exception as err:  # reported, the rest go on
        row["error"] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    return row


def choose(tile_rows: list[dict], gemm_rows: list[dict], epilogue: dict | None = None) -> dict:
    """The faster design by forward + backward milliseconds: what ``linear_token_logprobs.DESIGN`` should be
    (the epilogue's backward is the 2-D plan's, ``epilogue["gemm_2d"]``)."""
    best = {}
    for design, rows in (("tiles", tile_rows), ("gemm", gemm_rows)):
        timed = [r for r in rows if "fwd_ms" in r and "bwd_ms" in r]
        if timed:
            best[design] = min(timed, key=lambda r: r["fwd_ms"] + r["bwd_ms"])
    if epilogue and "fwd_ms" in epilogue and "bwd_ms" in epilogue["gemm_2d"]:
        best["epilogue"] = {"fwd_ms": epilogue["fwd_ms"]["epilogue"], "bwd_ms": epilogue["gemm_2d"]["bwd_ms"]}
    if not best:
        return {"design": None}
    design = min(best, key=lambda d: best[d]["fwd_ms"] + best[d]["bwd_ms"])
    return {"design": design, **{d: r["fwd_ms"] + r["bwd_ms"] for d, r in best.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench head_tiles", description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--split-rows", type=int, default=4096, help="the rows of the vocabulary-split comparison")
    parser.add_argument("--rep-ms", type=int, default=200, help="milliseconds of calls timed per case")
    parser.add_argument("--also-hidden", type=int, default=None, help="the epilogue against gemm at this H too")
    parser.add_argument("--out", default="bench_out/head_tiles.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error(
            "head_tiles times Triton's compiled kernels: it needs a CUDA device (or, to try it, the interpreter)"
        )
    from ppo_fast.backends.triton import linear_token_logprobs as module

    result = {**result_header("head_tiles", argv, device), "epilogue": []}
    for hidden in (args.hidden, args.also_hidden)[: 1 + bool(args.also_hidden)]:  # the design question first
        result["epilogue"].append(epilogue_against_gemm(module, args.rows, hidden, args.vocab, device, args.rep_ms))
        write_json(args.out, result)  # kept should the time run out
    epilogue = result["epilogue"][0]
    head = _head(args.rows, args.hidden, args.vocab, device)
    flops = 2 * args.rows * args.hidden * args.vocab  # one product of the head
    products_ms = _ms(lambda: head[0] @ head[1].T, args.rep_ms)
    result = {
        **result,
        "shape": {"rows": args.rows, "hidden": args.hidden, "vocab": args.vocab, "dtype": "bfloat16"},
        "products_ms": products_ms,
        "products_tflops": flops / products_ms / 1e9,
    }
    rows, want = [], None
    for config in CANDIDATES:
        row = measure(module, config, head, args.rep_ms, want)
        if want is None and "error" not in row:
            with _tiles(module, config):
                want = module.linear_token_logprobs_forward(*head, None, **OPTIONS, return_entropy=True)[0]
        if "fwd_ms" in row:
            row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
            row["bwd_tflops"] = 3 * flops / row["bwd_ms"] / 1e9  # the recompute and the two gradients' products
        rows.append(row)
        print(f"  {config}: {row}", flush=True)
        write_json(args.out, {**result, "results": rows})  # each candidate kept, should the time run out
    split = {}
    small = _head(args.split_rows, args.hidden, args.vocab, device)
    for label, splits in (("split", None), ("one share", 1)):
        saved, module.FORWARD_SPLITS = module.FORWARD_SPLITS, splits
        try:
            split[label] = measure(module, CANDIDATES[0], small, args.rep_ms, None)["fwd_ms"]
        finally:
            module.FORWARD_SPLITS = saved
    print(f"  forward at {args.split_rows} rows: {split}", flush=True)
    scratch = {}
    for mib in (16, 64, 256):
        saved, module.GRADIENT_SCRATCH_BYTES = module.GRADIENT_SCRATCH_BYTES, mib << 20
        try:
            scratch[mib] = measure(module, CANDIDATES[0], head, args.rep_ms, None).get("bwd_ms")
        finally:
            module.GRADIENT_SCRATCH_BYTES = saved
    print(f"  backward by its gradient scratch (MiB): {scratch}", flush=True)
    gemm_rows = []
    for plan in GEMM_PLANS:
        gemm_rows.append(measure_gemm(plan, head, args.rep_ms, want))
        print(f"  GEMM-first, plan {plan}: {gemm_rows[-1]}", flush=True)
    chosen = choose(rows, gemm_rows, epilogue)
    print(f"  the faster design, forward + backward ms: {chosen}", flush=True)
    write_json(
        args.out,
        {
            **result,
            "results": rows,
            "split_rows": args.split_rows,
            "split_fwd_ms": split,
            "scratch_bwd_ms": scratch,
            "gemm_results": gemm_rows,
            "chosen": chosen,
        },
    )
    return 0
