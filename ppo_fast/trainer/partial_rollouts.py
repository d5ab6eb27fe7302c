"""Partial rollouts (``--partial-rollouts N``, with ``--max-staleness K`` > 0; docs/async.md): the producer
generates in rounds of at most N new tokens per response (and at most ``--partial-rollout-seconds S``: the
round ends at the token sampled when S have passed), so a batch no longer waits for its longest
response.  A response not finished after a round keeps its prefix (tokens, behaviour log-probs mu, and the
policy version and step of the weights that sampled each token) and is continued in the next round, under
the newest weights the producer holds then.

- The pool holds up to ``batch_size`` groups being generated; each round tops it up with fresh prompts,
  continues every unfinished response, and moves a group whose responses have all ended (EOS, or the
  response length) to the finished groups.  A batch is ``batch_size`` finished groups, oldest tokens first.
- A group's age is counted from its oldest token.  Under ``--staleness-policy wait`` the pool admits a group
  only where it can be trained within K updates, and finishes the groups due in a batch before sending it;
  before each round (under either policy) it drops a group that could no longer be trained within K.
- mu of each token is the engine's under the weights that sampled it; the off-policy loss corrects per token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .config import ConfigError
from .rollout import batch_from_responses, decode_responses, encode_prompts
from .rollout_source import Generated, draw, sampling

# With --partial-rollouts (ProducerSource.metrics; glossary: metric_glossary.py).
METRICS = {
    "async/span/<s>": "the responses whose tokens were sampled by weights s updates apart (newest minus oldest; "
    "0 = one set of weights), s = 0 .. K: the step's trajectory-span histogram (--partial-rollouts)",
    "async/partial_rounds": "the generation rounds (at most --partial-rollouts tokens per response each) the "
    "producer ran while it made this batch",
    "async/partial_timed_out": "the rounds of this batch in which --partial-rollout-seconds ran out (each "
    "ended at the token then sampled)",
    "async/partial_continued": "the responses of this batch continued from a prefix of an earlier round",
    "async/partial_dropped": "groups whose unfinished or waiting responses grew older than --max-staleness "
    "before they could be trained, dropped by the producer while it made this batch (wasted generation)",
}


def check(cfg, response_length: int) -> None:
    """``ConfigError`` naming ``--partial-rollouts`` where a round's budget is not below the response length."""
    if cfg.partial_rollouts >= response_length:
        raise ConfigError(
            f"--partial-rollouts {cfg.partial_rollouts}: a round's budget must be below the response length "
            f"({response_length} tokens here), or no response is ever continued; use a smaller budget, or 0"
        )


@dataclass(kw_only=True)
class _Group:
    """One prompt's ``group_size`` responses, being generated: per row the tokens so far, their mu, and the
    version and step of the weights that sampled each; which rows have ended; when it was admitted."""

    drawn: list[int]
    texts: list[str]
    answers: list
    order: int
    tokens: list[list[int]] = field(default_factory=list)
    mu: list[list[float]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    steps: list[list[int]] = field(default_factory=list)
    ended: list[bool] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)

    def __post_init__(self):
        rows = len(self.texts)
        self.tokens, self.mu = [[] for _ in range(rows)], [[] for _ in range(rows)]
        self.versions, self.steps = [[] for _ in range(rows)], [[] for _ in range(rows)]
        self.ended, self.rounds = [False] * rows, [0] * rows

    @property
    def oldest(self) -> int:
        """The step of the oldest weights that sampled one of its tokens (none yet: a new group)."""
        return min((s[0] for s in self.steps if s), default=1 << 62)


class Pool:
    """The responses being generated over rounds (see the module's docstring).  ``spec``: the producer's
    (options, prompts, tokenizer, response length, device); ``shard``: the prompts' indices it draws from;
    ``clock()``: seconds, for ``--partial-rollout-seconds``."""

    def __init__(self, spec, shard: list[int], clock=time.monotonic):
        self.cfg, self.spec, self.shard, self.clock = spec.cfg, spec, shard, clock
        self.active: list[_Group] = []
        self.finished: list[_Group] = []
        self.admitted = 0
        self.timed_out = 0  # the rounds of the batch being made that the clock ended
        self.mu_given = True

    def held(self) -> int:
        """The groups that hold generated tokens and are not yet sent: dropped if the producer stops."""
        return len(self.finished) + sum(any(g.tokens) for g in self.active)

    def next_batch(self, engine, scorer, refresh) -> Generated:
        """The next batch of ``batch_size`` finished groups, rewarded by ``scorer``.  ``refresh()`` runs before
        each round: it adopts the newest weights and returns ``(version, step, floor)``, ``floor`` the lowest
        step the batch can be trained at (a group older than ``floor - K`` is dropped).

        Under ``wait`` the batch is trained at step ``floor`` exactly, so the pool plans: a group whose oldest
        token is K steps older than ``floor`` is due in this batch, and the rounds go on until it has
        finished; a fresh group is admitted only while the groups held fit the batches left before their
        deadline (``_room``).  A group is then dropped only where more fall due in one batch than it holds."""
        cfg, rounds, dropped = self.cfg, 0, 0
        self.timed_out = 0
        wait = cfg.staleness_policy == "wait"
        while True:
            version, step, floor = refresh()
            dropped += self._drop_older_than(floor - cfg.max_staleness)
            due = wait and any(g.oldest + cfg.max_staleness <= floor for g in self.active)
            if len(self.finished) >= cfg.batch_size and not due:
                break
            self._admit(self._room(step, floor) if wait else cfg.batch_size - len(self.active))
            self._round(engine, version, step)
            rounds += 1
        self.finished.sort(key=lambda g: (g.oldest, g.order))
        taken, self.finished = self.finished[: cfg.batch_size], self.finished[cfg.batch_size :]
        g = self._generated(taken, scorer)
        continued = sum(n > 1 for group in taken for n in group.rounds)
        g.timing = {"rounds": rounds, "partial_dropped": dropped, "continued": continued, "timed_out": self.timed_out}
        return g

    def _drop_older_than(self, limit: int) -> int:
        keep_active = [g for g in self.active if g.oldest >= limit]
        keep_finished = [g for g in self.finished if g.oldest >= limit]
        dropped = len(self.active) + len(self.finished) - len(keep_active) - len(keep_finished)
        self.active, self.finished = keep_active, keep_finished
        return dropped

    def _room(self, step: int, floor: int) -> int:
        """Under ``wait``: the fresh groups that fit.  One admitted now (at ``step``) must be trained by step
        ``step + K``, and the batches of steps ``floor`` .. ``step + K`` take ``batch_size`` groups each: the
        groups held (finished or not, all due by then) and it must fit in them.  At most ``batch_size``
        groups are generated at once."""
        cfg = self.cfg
        batches = step + cfg.max_staleness - floor + 1
        held = len(self.active) + len(self.finished)
        return min(cfg.batch_size - len(self.active), cfg.batch_size * batches - held)

    def _admit(self, missing: int) -> None:
        """``missing`` fresh groups, their prompts drawn as a batch draws them."""
        cfg, train_set = self.cfg, self.spec.train_set
        if missing <= 0:
            return
        drawn, texts, answers = draw(train_set, self.shard, missing, cfg.group_size)
        for i in range(missing):
            rows = slice(i * cfg.group_size, (i + 1) * cfg.group_size)
            self.active.append(_Group(drawn=drawn[rows], texts=texts[rows], answers=answers[rows], order=self.admitted))
            self.admitted += 1

    def _round(self, engine, version: int, step: int) -> None:
        """One round: every unfinished response continued by at most ``--partial-rollouts`` tokens, and for at
        most ``--partial-rollout-seconds``."""
        spec, eos = self.spec, self.spec.tokenizer.eos_token_id
        rows = [(g, r) for g in self.active for r in range(len(g.texts)) if not g.ended[r]]
        keywords = sampling(self.cfg, self.cfg.partial_rollouts) | {"device": spec.device}
        if seconds := self.cfg.partial_rollout_seconds:
            keywords["time_up"] = self._time_up(seconds)
        batch, mu = engine.generate(
            spec.tokenizer, [g.texts[r] for g, r in rows], prefixes=[g.tokens[r] for g, r in rows], **keywords
        )
        self.mu_given = self.mu_given and mu is not None
        ids, mask = batch.response_ids.cpu(), batch.response_mask.cpu()
        mu = None if mu is None else mu.float().cpu()
        for i, (g, r) in enumerate(rows):
            room = spec.response_length - len(g.tokens[r])
            new = ids[i][mask[i]][:room].tolist()
            if not new:
                raise RuntimeError(
                    f"--partial-rollouts: the {engine.info.name} engine continued a response by no token"
                )
            g.tokens[r] += new
            g.mu[r] += [] if mu is None else mu[i][mask[i]][:room].tolist()
            g.versions[r] += [version] * len(new)
            g.steps[r] += [step] * len(new)
            g.rounds[r] += 1
            g.ended[r] = eos in new or len(g.tokens[r]) >= spec.response_length
        self.finished += [g for g in self.active if all(g.ended)]
        self.active = [g for g in self.active if not all(g.ended)]

    def _time_up(self, seconds: float):
        """``time_up()`` for a round that starts now: True once ``seconds`` have passed (counted in
        ``timed_out``, once a round)."""
        start, said = self.clock(), []

        def time_up() -> bool:
            up = self.clock() - start >= seconds
            if up and not said:
                said.append(True)
                self.timed_out += 1
            return up

        return time_up

    def _generated(self, groups: list[_Group], scorer) -> Generated:
        """``groups`` as the batch the trainer takes: prompts left-padded as ``encode_prompts`` pads them, the
        responses right-padded, mu and the per-token versions and steps laid out as the response tokens."""
        spec = self.spec
        drawn = [i for g in groups for i in g.drawn]
        texts = [t for g in groups for t in g.texts]
        answers = [a for g in groups for a in g.answers]
        tokens = [t for g in groups for t in g.tokens]
        width = max(map(len, tokens))

        def laid_out(name: str, dtype) -> torch.Tensor:
            rows = [row for g in groups for row in getattr(g, name)]
            return torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=dtype)

        mask = torch.tensor([[True] * len(t) + [False] * (width - len(t)) for t in tokens])
        enc = encode_prompts(spec.tokenizer, texts, "cpu")
        batch = batch_from_responses(enc, laid_out("tokens", torch.long), mask, spec.tokenizer.pad_token_id)
        responses = decode_responses(spec.tokenizer, batch)
        columns = spec.train_set.columns_of(drawn)
        scores = scorer(texts, responses, spec.device, answers, columns)
        versions, steps = laid_out("versions", torch.long), laid_out("steps", torch.long)
        oldest = min(range(len(tokens)), key=lambda i: steps[i][0].item())
        return Generated(
            prompts=texts,
            answers=answers,
            columns=columns,
            batch=batch,
            engine_logprobs=laid_out("mu", torch.float32) if self.mu_given else None,
            responses=responses,
            scores=scores,
            reward_metrics=scorer.metrics(),
            version=int(versions[oldest][0]),
            weights_step=int(steps[oldest][0]),
            token_versions=versions,
            token_steps=steps,
        )


def metrics(g: Generated, step: int, max_staleness: int, group_size: int) -> dict:
    """A partial batch's staleness histogram by each group's own age (from its oldest token), its span
    histogram (``METRICS``) and the producer's rounds and drops for it; ``step``: the trainer's, before
    this batch's update."""
    mask = g.batch.response_mask.cpu()
    steps = g.token_steps
    oldest = steps.masked_fill(~mask, 1 << 62).amin(-1)
    newest = steps.masked_fill(~mask, -1).amax(-1)
    ages = (step - oldest.view(-1, group_size).amin(-1)).tolist()
    spans = (newest - oldest).tolist()
    return {
        **{f"async/staleness/{a}": ages.count(a) for a in range(max_staleness + 1)},
        **{f"async/span/{s}": spans.count(s) for s in range(max_staleness + 1)},
        "async/partial_rounds": g.timing["rounds"],
        "async/partial_timed_out": g.timing["timed_out"],
        "async/partial_continued": g.timing["continued"],
        "async/partial_dropped": g.timing["partial_dropped"],
    }
