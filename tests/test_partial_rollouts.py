"""Partial rollouts (--partial-rollouts N with --max-staleness K > 0, ppo_fast/trainer/partial_rollouts.py):
a response longer than the budget is completed over several rounds, each token tagged with the version of the
weights that sampled it and carrying the behaviour log-prob mu under them; groups too old are dropped; the
span histogram; the refusals; then the trainer with a producer."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ppo_fast.trainer import ConfigError, PPOTrainer, TrainerConfig, checkpoint, default_task
from ppo_fast.trainer.metric_glossary import undocumented
from ppo_fast.trainer.metrics import METRICS_FILE, read_metrics
from ppo_fast.trainer.partial_rollouts import Pool, check, metrics
from ppo_fast.trainer.prompts import Prompts
from ppo_fast.trainer.rollout import batch_from_responses, encode_continuations, forward
from ppo_fast.trainer.rollout_hf import HFEngine
from ppo_fast.trainer.scoring import FunctionScorer, Rewards

TOKENIZER = default_task.build_tokenizer()  # ids: 0 <pad>, 1 <eos>, 2..11 the digits
EOS = TOKENIZER.eos_token_id
# The scripted engine's whole response to each prompt: "12+34=" ends with its EOS after 4 digits (5 tokens);
# "123+456=" runs to the response length (6) with no EOS; "1+1=" is its EOS alone.
SCRIPT = {"12+34=": [4, 5, 6, 7, EOS], "123+456=": [2, 3, 4, 5, 6, 7, 8], "1+1=": [EOS]}


class ScriptedEngine:
    """Continues each row's prefix along ``SCRIPT`` (checking that the prefix is the script's start), at most
    ``max_new_tokens`` tokens, up to the EOS; mu of the token at response position t under ``version``:
    -(version + 1) - t / 100, so a token's mu says which weights sampled it."""

    info = SimpleNamespace(name="scripted")

    def __init__(self):
        self.version, self.calls = 0, []

    def generate(self, tokenizer, prompts, *, prefixes, max_new_tokens, device, **sampling):
        self.calls.append(len(prompts))
        rows, mu = [], []
        for prompt, prefix in zip(prompts, prefixes):
            script = SCRIPT[prompt]
            assert script[: len(prefix)] == prefix, "a continued response lost its prefix"
            new = script[len(prefix) : len(prefix) + max_new_tokens]
            rows.append(new)
            mu.append([-(self.version + 1) - (len(prefix) + j) / 100 for j in range(len(new))])
        width = max(map(len, rows))
        mask = torch.tensor([[j < len(r) for j in range(width)] for r in rows])
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        enc = encode_continuations(tokenizer, prompts, prefixes, "cpu")
        mu = torch.tensor([m + [0.0] * (width - len(m)) for m in mu])
        return batch_from_responses(enc, ids, mask, tokenizer.pad_token_id), mu


def _pool(prompts, *, budget=2, max_staleness=2, batch_size=2, group_size=2, response_length=6, **cfg) -> Pool:
    cfg = TrainerConfig(
        batch_size=batch_size,
        group_size=group_size,
        max_staleness=max_staleness,
        partial_rollouts=budget,
        **cfg,
    )
    spec = SimpleNamespace(
        cfg=cfg, train_set=Prompts(prompts), tokenizer=TOKENIZER, response_length=response_length, device="cpu"
    )
    return Pool(spec, list(range(len(prompts))))


def _scorer():
    return Rewards([FunctionScorer(lambda prompts, responses: [float(len(r)) for r in responses])], [1.0])


def _updates(engine, rounds):
    """``refresh`` for ``rounds`` of ``(version, step, floor)``, the last repeated; it sets the engine's version."""
    seen = []

    def refresh():
        version, step, floor = rounds[min(len(seen), len(rounds) - 1)]
        seen.append((version, step, floor))
        engine.version = version
        return version, step, floor

    return refresh


def _response_tokens(g, row: int) -> list[int]:
    return g.batch.response_ids[row][g.batch.response_mask[row]].tolist()


def test_a_response_longer_than_the_budget_completes_over_rounds_each_token_tagged_with_its_weights():
    engine = ScriptedEngine()
    pool = _pool(["12+34="])
    # An update between every two rounds: versions 0, 2, 4 (two optimizer steps each), steps 0, 1, 2.
    g = pool.next_batch(engine, _scorer(), _updates(engine, [(0, 0, 0), (2, 1, 0), (4, 2, 0)]))
    assert engine.calls == [4, 4, 4]  # 2 groups of 2 rows, continued twice
    assert g.timing["rounds"] == 3 and g.timing["continued"] == 4 and g.timing["partial_dropped"] == 0
    for row in range(4):
        assert _response_tokens(g, row) == SCRIPT["12+34="]
        assert g.token_versions[row].tolist() == [0, 0, 2, 2, 4]
        assert g.token_steps[row].tolist() == [0, 0, 1, 1, 2]
        # mu of each token is the engine's under the weights that sampled it (ScriptedEngine's formula)
        expected = [-1.00, -1.01, -3.02, -3.03, -5.04]
        torch.testing.assert_close(g.engine_logprobs[row], torch.tensor(expected), rtol=0, atol=1e-6)
    assert (g.version, g.weights_step) == (0, 0)  # the batch's oldest token
    assert g.responses == ["2345"] * 4 and g.scores.tolist() == [4.0] * 4
    row = metrics(g, step=2, max_staleness=2, group_size=2)
    # trained at step 2: both groups 2 updates old from their oldest token; each response spans steps 0 .. 2
    assert [row[f"async/staleness/{a}"] for a in range(3)] == [0, 0, 2]
    assert [row[f"async/span/{s}"] for s in range(3)] == [0, 0, 4]
    assert not undocumented(row), undocumented(row)


def test_finished_groups_go_first_and_unfinished_ones_carry_into_the_next_batch():
    engine = ScriptedEngine()
    pool = _pool(["1+1=", "123+456="], batch_size=2, group_size=1)
    torch.manual_seed(0)  # draws: short A, long B (round 1), long C (round 2), short D (round 4)
    refresh = _updates(engine, [(0, 0, 0), (2, 1, 0), (4, 2, 0), (6, 3, 0)])
    first, second = (pool.next_batch(engine, _scorer(), refresh) for _ in range(2))
    # Round 1 ends A; round 2 admits C beside B; round 3 ends B: the first batch is A and B, and C, unfinished,
    # carries its 4 tokens into the second batch's round 4, which ends it under the newest weights, and D.
    assert first.prompts == ["1+1=", "123+456="] and second.prompts == ["123+456=", "1+1="]
    tagged = [
        (_response_tokens(g, row), g.token_versions[row][: len(_response_tokens(g, row))].tolist())
        for g in (first, second)
        for row in range(2)
    ]
    assert tagged == [
        ([EOS], [0]),
        (SCRIPT["123+456="][:6], [0, 0, 2, 2, 4, 4]),
        (SCRIPT["123+456="][:6], [2, 2, 4, 4, 6, 6]),
        ([EOS], [6]),
    ]
    for g in (first, second):
        for row, (tokens, versions) in enumerate(tagged[:2] if g is first else tagged[2:]):
            expected = [-(v + 1) - t / 100 for t, v in enumerate(versions)]
            torch.testing.assert_close(g.engine_logprobs[row][: len(tokens)], torch.tensor(expected), rtol=0, atol=1e-6)
    assert [g.timing["rounds"] for g in (first, second)] == [3, 1]
    assert [g.timing["continued"] for g in (first, second)] == [1, 1]
    assert (second.version, second.weights_step) == (2, 1)  # C's first token
    assert pool.held() == 0
    row = metrics(second, step=3, max_staleness=2, group_size=1)  # trained at step 3: C 2 updates old, D none
    assert [row[f"async/staleness/{a}"] for a in range(3)] == [1, 0, 1]
    assert [row[f"async/span/{s}"] for s in range(3)] == [1, 0, 1]


def test_a_group_that_grows_older_than_the_bound_is_dropped_and_counted():
    engine = ScriptedEngine()
    pool = _pool(["123+456="], batch_size=1, group_size=1, max_staleness=1, staleness_policy="drop")
    # The trainer publishes step 2 during the group's second round: started at step 0, it can no longer be
    # trained within 1 update, so it is dropped, and a fresh one is generated under step 1's weights.
    g = pool.next_batch(engine, _scorer(), _updates(engine, [(0, 0, 0), (2, 1, 2)]))
    assert g.timing["partial_dropped"] == 1 and g.timing["rounds"] == 4
    assert g.token_steps[0].tolist() == [1] * 6 and g.token_versions[0].tolist() == [2] * 6  # the fresh one
    assert metrics(g, step=2, max_staleness=1, group_size=1)["async/partial_dropped"] == 1


def test_wait_at_the_bound_admits_no_more_than_the_batch_and_finishes_what_is_due():
    """Under wait, with the producer K updates ahead (weights of step 0 for the batch trained at step 1, K = 1),
    a group admitted now must be trained in this batch: no fresh group beyond the batch, and the batch waits
    for its long response; nothing is carried over, nothing dropped.  With one update of slack (the weights of
    step 1) the same draws carry the long response admitted in the second round into the next batch."""
    runs = {}
    for step in (0, 1):
        engine = ScriptedEngine()
        pool = _pool(["1+1=", "123+456="], batch_size=2, group_size=1, max_staleness=1)
        torch.manual_seed(0)  # draws: short, long, then long
        g = pool.next_batch(engine, _scorer(), _updates(engine, [(2 * step, step, 1)]))
        runs[step] = (engine.calls, g.prompts, g.timing["partial_dropped"], pool.held())
    assert runs[0] == ([2, 1, 1], ["1+1=", "123+456="], 0, 0)
    assert runs[1] == ([2, 2, 2], ["1+1=", "123+456="], 0, 1)


def test_hf_engine_mu_of_a_continued_response_is_the_engines_under_each_version():
    """Through the pool, the HF engine continues responses under new weights: each token's mu equals the
    trainer's sampling-aware log-prob under the weights that sampled it (1e-4, as the engine test bounds the
    KV cache's summation order), and the other weights' differs (the test tells the versions apart)."""
    policy = default_task.build_model(TOKENIZER, seed=5).eval()
    engine = HFEngine(policy, autocast=contextlib.nullcontext, synced_gpus=False)
    prompts = [default_task.prompt(a, b) for a, b in ((12, 34), (56, 78), (99, 10), (11, 11))]
    pool = _pool(prompts, batch_size=4, group_size=2, response_length=4, temperature=0.7, top_k=5)
    old = {k: v.clone() for k, v in policy.state_dict().items()}
    torch.manual_seed(0)

    def refresh():
        if refresh.calls == 1:  # an update between the two rounds
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(0.05 * torch.randn_like(p))
        refresh.calls += 1
        return 2 * (refresh.calls - 1), refresh.calls - 1, 0

    refresh.calls = 0
    g = pool.next_batch(engine, _scorer(), refresh)
    new = {k: v.clone() for k, v in policy.state_dict().items()}
    mask, truncation = g.batch.response_mask, pool.cfg.logprob_truncation()
    scores = {}
    for version, state in ((0, old), (2, new)):
        policy.load_state_dict(state)
        with torch.no_grad():
            scores[version], _, _ = forward(policy, None, g.batch, temperature=0.7, truncation=truncation)
    for version, other in ((0, 2), (2, 0)):
        at = mask & (g.token_versions == version)
        assert at.any()
        assert (g.engine_logprobs - scores[version])[at].abs().max().item() <= 1e-4
        assert (g.engine_logprobs - scores[other])[at].abs().max().item() > 1e-2


class FakeClock:
    """Seconds that advance by one at each reading: a round's time budget ends after a known count of tokens."""

    def __init__(self):
        self.now = -1.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_hf_engine_ends_a_round_on_the_time_budget_and_continues_it_exactly():
    """--partial-rollout-seconds 2 under a clock that ticks once a reading (the round's start, then one reading
    per token): every round ends at its second token, before --partial-rollouts 3, and the next round continues
    it under the newer weights; each token's mu equals the trainer's log-prob under the weights that sampled it,
    as with the token budget alone."""
    policy = default_task.build_model(TOKENIZER, seed=5).eval()
    engine = HFEngine(policy, autocast=contextlib.nullcontext, synced_gpus=False)
    prompts = [default_task.prompt(a, b) for a, b in ((12, 34), (56, 78), (99, 10), (11, 11))]
    pool = _pool(prompts, budget=3, batch_size=4, group_size=2, response_length=5, temperature=0.7, top_k=5)
    pool.cfg.partial_rollout_seconds = 2.0
    pool.clock = FakeClock()
    states = []
    torch.manual_seed(1)

    def refresh():
        if states:  # an update before every round but the first
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(0.05 * torch.randn_like(p))
        states.append({k: v.clone() for k, v in policy.state_dict().items()})
        return 2 * (len(states) - 1), len(states) - 1, 0

    g = pool.next_batch(engine, _scorer(), refresh)
    mask = g.batch.response_mask
    lengths = mask.sum(-1).tolist()
    for row, n in enumerate(lengths):
        # two tokens a round: versions 0, 0, 2, 2, 4 (each update two optimizer steps), cut by the row's EOS
        assert g.token_versions[row][:n].tolist() == [0, 0, 2, 2, 4][:n]
    assert max(lengths) == 5, lengths  # a response ran over three rounds
    assert g.timing["rounds"] == 3 and g.timing["timed_out"] == 3  # none reached 3 tokens in a round
    truncation = pool.cfg.logprob_truncation()
    for version, state in enumerate(states[:3]):  # the weights of the rounds (the last refresh ended the batch)
        policy.load_state_dict(state)
        with torch.no_grad():
            scores, _, _ = forward(policy, None, g.batch, temperature=0.7, truncation=truncation)
        at = mask & (g.token_versions == 2 * version)
        assert at.any()
        assert (g.engine_logprobs - scores)[at].abs().max().item() <= 1e-4
        assert (g.engine_logprobs - scores)[mask & ~(g.token_versions == 2 * version)].abs().max().item() > 1e-2
    assert metrics(g, step=2, max_staleness=2, group_size=2)["async/partial_timed_out"] == 3


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(partial_rollouts=2), r"partial_rollouts \(--partial-rollouts\) continues responses under newer weights"),
        (dict(partial_rollouts=2, max_staleness=1, stop_strings="x"), r"and --stop-strings cannot be used together"),
        (dict(partial_rollout_seconds=1.5, max_staleness=1), r"bounds the rounds of --partial-rollouts N"),
    ],
    ids=["synchronous", "stop_strings", "seconds_alone"],
)
def test_refusals_name_the_option(options, match):
    with pytest.raises(ConfigError, match=match):
        TrainerConfig(**options).validate()


def test_a_budget_not_below_the_response_length_is_refused():
    with pytest.raises(ConfigError, match=r"--partial-rollouts 4: a round's budget must be below the response length"):
        check(TrainerConfig(partial_rollouts=4, max_staleness=1), 4)
    check(TrainerConfig(partial_rollouts=3, max_staleness=1), 4)


def test_the_trainer_trains_on_partial_rollouts_and_a_resume_says_what_was_dropped(tiny_config):
    cfg = tiny_config(steps=2, max_staleness=2, partial_rollouts=2, eval_size=0)
    PPOTrainer(cfg).train()
    rows = read_metrics(Path(cfg.output_dir) / METRICS_FILE)
    for row in rows:
        assert sum(row[f"async/staleness/{a}"] for a in range(3)) == cfg.batch_size
        assert sum(row[f"async/span/{s}"] for s in range(3)) == cfg.batch_size * cfg.group_size
        assert row["async/age"] <= 2  # wait: counted from the oldest token, within the bound
        assert not undocumented(row), undocumented(row)
    # The warmed-up model's answers take 3 or 4 tokens, 2 per round: responses were continued.
    assert sum(row["async/partial_continued"] for row in rows) > 0
    saved = checkpoint.latest(Path(cfg.output_dir))
    state = torch.load(saved / checkpoint.STATE_FILE, weights_only=True)
    torch.save(state | {"partial_in_flight": 3}, saved / checkpoint.STATE_FILE)  # as a producer holding 3
    said = []
    PPOTrainer(tiny_config(steps=2, max_staleness=2, partial_rollouts=2, eval_size=0, resume=True), log=said.append)
    assert any("the 3 group(s) of --partial-rollouts the producer held at step 2" in line for line in said), said
