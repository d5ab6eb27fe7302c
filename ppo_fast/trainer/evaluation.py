"""Held-out evaluation: greedy responses to the held-out prompts, scored by the run's reward."""

from __future__ import annotations

import json

import torch

from .prompts import exact_match
from .rollout import decode_responses, generate
from .run_folder import SUMMARY_FILE

# The held-out metrics (glossary: metric_glossary.py), every --eval-every steps.
METRICS = {
    "eval/score": "mean reward of the policy's greedy responses to the held-out prompts",
    "eval/exact_match": "share of held-out greedy responses equal to their reference answer (when every prompt has one)",
}

CHUNK = 256  # prompts decoded at once


@torch.no_grad()
def held_out(run, model) -> dict[str, float]:
    """``eval/score`` (the mean reward of ``model``'s greedy responses to the held-out prompts), and
    ``eval/exact_match`` when every held-out prompt has a reference answer.  Empty without held-out prompts.

    Each rank decodes its share of the prompts and the sums are all-reduced, unless the
    weights are sharded (every rank must then run the same forward passes: each decodes all)."""
    eval_set, parallel = run.eval_set, run.parallel
    count = len(eval_set.texts)
    if not count:
        return {}
    split = not parallel.synced_generation
    mine = parallel.shard(count) if split else range(count)
    score_sum = match_sum = 0.0
    for i in range(0, len(mine), CHUNK):
        indices = mine[i : i + CHUNK]
        part = [eval_set.texts[j] for j in indices]
        part_answers = [eval_set.answers[j] for j in indices] if eval_set.answers else []
        part_columns = eval_set.columns_of(list(indices))
        batch = generate(
            model,
            run.tokenizer,
            part,
            max_new_tokens=run.response_length,
            temperature=1.0,
            top_p=1.0,
            greedy=True,
            synced_gpus=parallel.synced_generation,
        )
        responses = decode_responses(run.tokenizer, batch)
        score_sum += run.scorer(part, responses, run.device, part_answers, part_columns).double().sum().item()
        match_sum += sum(exact_match(responses, part_answers))
    if split:
        score_sum, match_sum = parallel.sums([score_sum, match_sum])
    result = {"eval/score": score_sum / count}
    if eval_set.all_answered:
        result["eval/exact_match"] = match_sum / count
    return result


def at_start(run) -> tuple[dict, dict]:
    """``(the run's start, where this process starts)``: the reference's held-out scores for a
    new run; for ``--resume``, the policy's at the resumed step, with the run's start as
    its summary.json recorded it (empty if it did not)."""
    if run.resumed_from is None:
        with run.reference_scope():
            before = held_out(run, run.reference)
        if before:
            run.log(f"held-out greedy {in_words(before)} before PPO ({len(run.eval_prompts)} prompts)")
        return before, before
    start = held_out(run, run.policy)
    run.log(f"resumed at step {run.step}" + (f": held-out greedy {in_words(start)}" if start else ""))
    summary_file = run.output_dir / SUMMARY_FILE
    earlier = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    before = {
        key: earlier[name]
        for key, name in (("eval/score", "eval_before"), ("eval/exact_match", "exact_match_before"))
        if isinstance(earlier.get(name), (int, float))
    }
    return before, start


def in_words(first: dict, second: dict | None = None) -> str:
    """``score 0.605 -> 0.913, exact match 0.600 -> 0.910`` (or one value each without ``second``)."""
    parts = []
    for key, name in (("eval/score", "score"), ("eval/exact_match", "exact match")):
        if key in first:
            value = f"{first[key]:.3f}" + (f" -> {second[key]:.3f}" if second and key in second else "")
            parts.append(f"{name} {value}")
    return ", ".join(parts)
