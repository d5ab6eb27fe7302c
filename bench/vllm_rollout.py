"""Rollout speed, ``--rollout-engine hf`` against ``vllm``: response tokens/s at the same batch, and the weight sync.

Both engines are called as the trainer calls them (``rollout.generate`` and
``VLLMEngine.generate``) on the same prompts, sampling at temperature 1 from a Llama built
in code (random weights: no downloads; EOS is rarely sampled, so both produce about
``batch x response_length`` tokens).  Each is warmed up once, then timed over ``--repeats``
calls (median).  ``sync_weights`` (the policy's weights into the engine, in place) is timed
the same way.  Writes ``vllm-rollout-<device>.json`` and prints a Markdown table.

    python -m bench vllm_rollout --device cpu --out bench/results     # in a venv with vllm
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .common import load_average, machine, versions

MODEL_SHAPES = {
    # name: (hidden, layers, heads, vocab); head_dim 64 (vLLM's CPU attention takes it)
    "llama-8M": (256, 4, 4, 8192),
    "llama-50M": (512, 8, 8, 32000),
}


def _llama(shape: str, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, vocab = MODEL_SHAPES[shape]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(device, dtype).eval()


def _timed(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up
    times, result = [], None
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def run(device: torch.device, shape: str, batch: int, response_length: int, repeats: int) -> dict:
    from ppo_fast.trainer import TrainerConfig, default_task
    from ppo_fast.trainer.rollout import generate
    from ppo_fast.trainer.rollout_vllm import VLLMEngine

    if device.type == "cpu":
        torch.set_num_threads(1)  # vLLM serves with one torch thread per worker on CPU; the trainer's default too
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = default_task.build_tokenizer()
    policy = _llama(shape, device, dtype)
    prompts = default_task.prompts(TrainerConfig())[0][:batch]
    sampling = dict(max_new_tokens=response_length, temperature=1.0, top_p=1.0, top_k=0, greedy=False)
    tokens = lambda b: int(b.response_mask.sum())  # noqa: E731

    hf_s, hf_batch = _timed(lambda: generate(policy, tokenizer, prompts, **sampling), repeats)
    with tempfile.TemporaryDirectory(prefix="ppo_fast_vllm_bench_") as model_dir:
        start = time.perf_counter()
        engine = VLLMEngine(
            policy,
            model_dir=model_dir,
            max_model_len=len(prompts[0]) + response_length + 1,
            max_num_seqs=batch,
            dtype=dtype,
            seed=0,
            gpu_memory_utilization=0.3,
            sleep=False,
        )
        start_s = time.perf_counter() - start
        vllm_s, (vllm_batch, _) = _timed(
            lambda: engine.generate(tokenizer, prompts, device=device, **sampling), repeats
        )
        sync_s, _ = _timed(lambda: engine.sync_weights(policy), repeats)
    params = sum(p.numel() for p in policy.parameters())
    return {
        "model": f"{shape} ({params / 1e6:.1f}M parameters, {dtype})".replace("torch.", ""),
        "batch": batch,
        "response_length": response_length,
        "repeats": repeats,
        "hf": {"seconds": hf_s, "tokens": tokens(hf_batch), "tokens_per_s": tokens(hf_batch) / hf_s},
        "vllm": {
            "seconds": vllm_s,
            "tokens": tokens(vllm_batch),
            "tokens_per_s": tokens(vllm_batch) / vllm_s,
            "engine_start_s": start_s,
            "weight_sync_s": sync_s,
        },
    }


def markdown(result: dict) -> str:
    hf, vllm = result["hf"], result["vllm"]
    return "\n".join(
        [
            "| model | batch x response | hf tokens/s | vllm tokens/s | vllm / hf | weight sync | engine start |",
            "|---|---|---|---|---|---|---|",
            f"| {result['model']} | {result['batch']} x {result['response_length']} | {hf['tokens_per_s']:.0f} | "
            f"{vllm['tokens_per_s']:.0f} | {vllm['tokens_per_s'] / hf['tokens_per_s']:.2f}x | {1e3 * vllm['weight_sync_s']:.0f} ms | "
            f"{vllm['engine_start_s']:.0f} s |",
        ]
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench vllm_rollout", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=tuple(MODEL_SHAPES), default="llama-8M")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--response-length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    import vllm

    device = torch.device(args.device)
    load_before = load_average()[0]
    result = run(device, args.model, args.batch, args.response_length, args.repeats)
    result.update(
        machine=machine(device),
        versions={**versions(), "vllm": vllm.__version__},
        load_average_1m=[load_before, load_average()[0]],
    )  # before, after: the machine may be shared
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"vllm-rollout-{device.type}.json"
    path.write_text(json.dumps(result, indent=2))
    print(markdown(result))
    print(f"machine: {result['machine']}; written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
