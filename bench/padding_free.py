"""Padding-free (``--padding-free``) against the padded layout: the update phase's forward and backward
(policy and a separate critic) on a long-tailed mix of response lengths, and the built-in job's step.

``update``: for each model (the built-in task's GPT-2 shape with 1024 positions, and a Llama-shaped
one), one batch of rows
with prompts of 8 to 24 tokens (left-padded) and lognormal response lengths (median ``--median``,
capped at 8x it), scored and differentiated as the trainer's update does it (``rollout.forward``
with entropy and values, then backward) in both layouts: response tokens per second (best of
``--repeats``), the real tokens' share of the padded layout, and the peak extra memory of one call
(CPU: peak-RSS rise, glibc's mmap threshold fixed; CUDA: ``max_memory_allocated``).

``step``: the built-in job (``ppo-fast train``'s defaults) for ``--steps`` steps padded and with every
micro-batch packed (its rows are too even for the shipped threshold, ``packing.PACK_BELOW``, which
leaves them padded): the mean seconds per step after the first, and the held-out accuracy at the end.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch

from .common import result_header, write_json
from .timing import memory_method, peak_extra_bytes


def models(quick: bool):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from ppo_fast.trainer import default_task

    tokenizer = default_task.build_tokenizer()
    torch.manual_seed(0)  # the built-in task's GPT-2, with room for long responses
    shape = {**default_task.MODEL_SHAPE, "n_positions": 1024}
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), activation_function="gelu", **shape))
    yield "gpt2-builtin-shape", gpt2.eval()
    torch.manual_seed(0)
    shape = (
        dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4, vocab_size=1024)
        if quick
        else dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8, vocab_size=32000)
    )
    config = LlamaConfig(**shape, num_key_value_heads=shape["num_attention_heads"], max_position_embeddings=2048)
    yield f"llama-{shape['hidden_size']}x{shape['num_hidden_layers']}", LlamaForCausalLM(config).float().eval()


def long_tailed_batch(vocab: int, rows: int, median: int, seed: int = 0):
    """Prompts of 8..24 tokens, left-padded; responses lognormal (sigma 0.8) around ``median``, at most 8x it."""
    from ppo_fast.trainer.rollout import Batch

    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(8, 25, (rows,), generator=generator)
    normal = torch.randn(rows, generator=generator)
    responses = (median * torch.exp(0.8 * normal)).round().clamp(1, 8 * median).long()
    width, longest = int(prompts.max()), int(responses.max())
    ids = torch.randint(vocab, (rows, width + longest), generator=generator)
    mask = torch.zeros(rows, width + longest, dtype=torch.bool)
    for row in range(rows):
        mask[row, width - int(prompts[row]) : width + int(responses[row])] = True
    return Batch(ids, mask, width)


def one_update(policy, critic, batch, packed: bool):
    from ppo_fast.trainer.rollout import forward

    logprobs, entropy, values = forward(
        policy, critic, batch, temperature=1.0, entropy=True, values=True, packed=packed
    )
    mask = batch.response_mask
    loss = (logprobs - 0.01 * entropy + 0.5 * values.square())[mask].mean()
    loss.backward()
    return loss.detach()


def update(device: torch.device, quick: bool, rows: int, median: int, repeats: int) -> dict:
    from ppo_fast.trainer.models import build_critic

    out = {}
    for name, policy in models(quick):
        policy = policy.to(device)
        critic = build_critic(policy, "separate")
        vocab = policy.get_output_embeddings().weight.shape[0]
        positions = getattr(policy.config, "n_positions", None) or policy.config.max_position_embeddings
        batch = long_tailed_batch(vocab, rows, min(median, positions // 10))
        batch = type(batch)(batch.input_ids.to(device), batch.attention_mask.to(device), batch.prompt_width)
        response_tokens = int(batch.response_mask.sum())
        row = {
            "rows": rows,
            "padded_shape": list(batch.input_ids.shape),
            "real_tokens": int(batch.attention_mask.sum()),
            "response_tokens": response_tokens,
            "response_lengths": {
                "median": float(batch.response_mask.sum(-1).float().median()),
                "max": int(batch.response_mask.sum(-1).max()),
            },
        }
        for layout, packed in (("padded", False), ("packed", True)):
            one_update(policy, critic, batch, packed)  # warm-up
            policy.zero_grad(set_to_none=True)
            critic.zero_grad(set_to_none=True)
            peak = peak_extra_bytes(lambda packed=packed: one_update(policy, critic, batch, packed), device.type)
            times = []
            for _ in range(repeats):
                policy.zero_grad(set_to_none=True)
                critic.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                one_update(policy, critic, batch, packed)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            row[layout] = {
                "best_s": min(times),
                "times_s": times,
                "response_tokens_per_s": response_tokens / min(times),
                "peak_extra_bytes": peak,
            }
            print(name, layout, f"{min(times):.3f} s", f"peak {peak / 2**20:.0f} MiB", flush=True)
        row["speedup"] = row["padded"]["best_s"] / row["packed"]["best_s"]
        row["peak_ratio"] = row["packed"]["peak_extra_bytes"] / max(row["padded"]["peak_extra_bytes"], 1)
        out[name] = row
    return out


def step(steps: int, seeds: list[int]) -> dict:
    from ppo_fast.trainer import PPOTrainer, TrainerConfig, packing
    from ppo_fast.trainer.metrics import METRICS_FILE, read_metrics

    runs = {"padded": [], "packed": []}
    shipped = packing.PACK_BELOW
    for seed in seeds:
        for layout, packed in (("padded", False), ("packed", True)):
            # Every micro-batch packed: the built-in task's rows are too even for the shipped threshold.
            packing.PACK_BELOW = 1.0 if packed else shipped
            with tempfile.TemporaryDirectory(prefix="ppo_fast_bench_packing_") as folder:
                cfg = TrainerConfig(
                    output_dir=folder, seed=seed, padding_free=packed, **({"steps": steps} if steps else {})
                )
                summary = PPOTrainer(cfg, log=lambda message: None).train()
                rows = read_metrics(Path(folder) / METRICS_FILE)
            seconds = [r["time/step"] for r in rows[1:]]
            result = {"seed": seed, "after": summary["eval_after"], "step_s": sum(seconds) / max(len(seconds), 1)}
            runs[layout].append(result)
            print(layout, result, flush=True)
    packing.PACK_BELOW = shipped
    means = {k: {m: sum(r[m] for r in v) / len(v) for m in ("after", "step_s")} for k, v in runs.items()}
    return {"runs": runs, "means": means, "packed_runs": "every micro-batch packed (PACK_BELOW = 1.0)"}


def markdown(data: dict) -> str:
    """The result file's tables: the update per model and layout, the built-in job per seed."""
    lines = []
    if "update" in data:
        lines += [
            "| model | rows x padded width | real tokens | response median / max | padded s | packed s | "
            "speed-up | padded peak MiB | packed peak MiB | peak ratio |",
            "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, row in data["update"].items():
            shape, lengths = row["padded_shape"], row["response_lengths"]
            lines.append(
                f"| {name} | {shape[0]} x {shape[1]} | {row['real_tokens']} "
                f"({row['real_tokens'] / (shape[0] * shape[1]):.0%}) | {lengths['median']:.0f} / {lengths['max']} | "
                f"{row['padded']['best_s']:.3f} | {row['packed']['best_s']:.3f} | {row['speedup']:.2f}x | "
                f"{row['padded']['peak_extra_bytes'] / 2**20:.0f} | {row['packed']['peak_extra_bytes'] / 2**20:.0f} | "
                f"{row['peak_ratio']:.2f} |"
            )
        lines.append("")
    if "step" in data:
        runs = data["step"]["runs"]
        lines += [
            "| seed | padded: s/step | packed: s/step | padded: held-out after | packed: held-out after |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        for off, on in zip(runs["padded"], runs["packed"]):
            lines.append(
                f"| {off['seed']} | {off['step_s']:.3f} | {on['step_s']:.3f} | {off['after']:.3f} | {on['after']:.3f} |"
            )
        means = data["step"]["means"]
        lines.append(
            f"| mean | {means['padded']['step_s']:.3f} | {means['packed']['step_s']:.3f} | "
            f"{means['padded']['after']:.3f} | {means['packed']['after']:.3f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench padding_free", description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("update", "step", "both"), default="both")
    parser.add_argument("--quick", action="store_true", help="small models, few rows and steps (a smoke test)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--median", type=int, default=48, help="median response length")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=0, help="steps of the built-in job (0: its default)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", default="bench_out/padding_free.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    result = {**result_header("padding_free", argv, device), "memory_method": memory_method(device.type)}
    if args.part in ("update", "both"):
        rows, median = (8, 12) if args.quick else (args.rows, args.median)
        result["update"] = update(device, args.quick, rows, median, 1 if args.quick else args.repeats)
    if args.part in ("step", "both"):
        seeds = [int(s) for s in args.seeds.split(",")][: 1 if args.quick else None]
        result["step"] = step(2 if args.quick else args.steps, seeds)
    write_json(args.out, result)
    return 0 if all(math.isfinite(r["speedup"]) for r in result.get("update", {}).values()) else 1
