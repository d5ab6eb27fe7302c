"""Where a step's rollouts come from: the generation side of a PPO step (draw the prompts, generate,
decode, reward), apart from the trainer's side (score them with the current weights, ``trainer.py``).

``SyncSource`` generates when the loop asks (``--max-staleness 0``); ``async_rollouts.AsyncSource`` takes
them from a producer process that generates while the trainer trains.  Both hand the loop a ``Generated``
tagged with the policy version that generated it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .rollout import Batch, decode_responses


@dataclass(kw_only=True)
class Generated:
    """A batch of rollouts as the generation side leaves it: the prompts drawn (one row per response), their
    answers and other columns, the responses (tokens and text), the engine's log-probs of them (None: it has
    none), their rewards with each reward's metrics, and the weights that generated them: ``version`` (the
    policy's optimizer steps) and ``weights_step`` (the trainer steps behind them: a batch's age is counted
    in steps, each one update of the producer's weights)."""

    prompts: list[str]
    answers: list[str | None]
    columns: dict[str, list]
    batch: Batch
    engine_logprobs: torch.Tensor | None
    responses: list[str]
    scores: torch.Tensor
    reward_metrics: dict[str, float]
    version: int
    weights_step: int
    timing: dict[str, float] = field(default_factory=dict)  # the producer's generate/reward/idle seconds

    def to(self, device: torch.device) -> Generated:
        """The tensors on ``device`` (a producer's come on the CPU)."""
        self.batch = Batch(
            self.batch.input_ids.to(device), self.batch.attention_mask.to(device), self.batch.prompt_width
        )
        if self.engine_logprobs is not None:
            self.engine_logprobs = self.engine_logprobs.to(device)
        self.scores = self.scores.to(device)
        return self


def draw(train_set, shard: list[int], prompts: int, group_size: int) -> tuple[list[int], list[str], list]:
    """``(rows, texts, answers)``: ``prompts`` prompts drawn from ``shard`` (indices of ``train_set``) with
    torch's generator, each repeated ``group_size`` times."""
    picks = [shard[i] for i in torch.randint(len(shard), (prompts,)).tolist()]
    drawn = [i for i in picks for _ in range(group_size)]
    return drawn, [train_set.texts[i] for i in drawn], [train_set.answers[i] for i in drawn]


def sampling(cfg, max_new_tokens: int) -> dict:
    """The engine's sampling keywords for training rollouts."""
    return dict(
        max_new_tokens=max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        min_p=cfg.min_p,
        greedy=False,
    )


def generate_and_reward(engine, *, tokenizer, scorer, texts, answers, columns, keywords: dict) -> tuple:
    """``(batch, engine log-probs, responses, scores, reward metrics)`` of ``texts`` by ``engine``."""
    batch, engine_logprobs = engine.generate(tokenizer, texts, **keywords)
    responses = decode_responses(tokenizer, batch)
    scores = scorer(texts, responses, keywords["device"], answers, columns)
    return batch, engine_logprobs, responses, scores, scorer.metrics()


class SyncSource:
    """Generates when the loop asks, with the policy's current weights (``--max-staleness 0``): the prompts
    drawn from the trainer's random stream, then the engine's responses, then the rewards."""

    is_async = False

    def __init__(self, run):
        self.run = run
        self.syncs_weights = run.engine.info.own_weights  # an engine with its own copy follows each update

    def start(self) -> None:
        pass

    def next(self) -> Generated:
        run, cfg = self.run, self.run.cfg
        shard = run.parallel.shard(len(run.prompts))
        drawn, texts, answers = draw(run.train_set, shard, run.parallel.per_rank(cfg.batch_size), cfg.group_size)
        columns = run.train_set.columns_of(drawn)
        keywords = sampling(cfg, run.response_length) | {"device": run.device}
        batch, engine_logprobs, responses, scores, metrics = generate_and_reward(
            run.engine,
            tokenizer=run.tokenizer,
            scorer=run.scorer,
            texts=texts,
            answers=answers,
            columns=columns,
            keywords=keywords,
        )
        return Generated(
            prompts=texts,
            answers=answers,
            columns=columns,
            batch=batch,
            engine_logprobs=engine_logprobs,
            responses=responses,
            scores=scores,
            reward_metrics=metrics,
            version=run.policy_version,
            weights_step=run.step,
        )

    def publish(self) -> None:
        """The updated weights to the engine that holds its own copy."""
        self.run.engine.sync_weights(self.run.policy)

    def metrics(self, generated: Generated) -> dict:
        return {}

    def in_flight(self) -> int:
        return 0  # nothing is generated ahead

    def close(self) -> None:
        self.run.engine.close()
