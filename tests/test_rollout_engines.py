"""The rollout-engine registry (ppo_fast.spec.ROLLOUT_ENGINES) behind --rollout-engine: the option's choices
are the registry's, every entry's module starts an Engine that carries its entry, the options are checked
against an engine's capabilities (not its name), and a new engine is one module and one registry entry."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from ppo_fast.spec import ROLLOUT_ENGINES, RolloutEngine
from ppo_fast.trainer import engine as engine_module
from ppo_fast.trainer.config import CHOICES, ConfigError, TrainerConfig
from ppo_fast.trainer.engine import Engine, EngineSetup


def test_the_options_choices_are_the_registry():
    assert CHOICES["rollout_engine"] == tuple(ROLLOUT_ENGINES)
    help_text = next(f for f in dataclasses.fields(TrainerConfig) if f.name == "rollout_engine").metadata["help"]
    for name, entry in ROLLOUT_ENGINES.items():
        assert f"{name} ({entry.summary})" in help_text


@pytest.mark.parametrize("name", sorted(ROLLOUT_ENGINES))
def test_each_entry_names_a_module_that_starts_its_engine(name):
    module = importlib.import_module(ROLLOUT_ENGINES[name].module)  # no engine package is imported yet
    assert callable(module.start)
    classes = [c for c in vars(module).values() if isinstance(c, type) and getattr(c, "info", None) is not None]
    assert [c.info for c in classes] == [ROLLOUT_ENGINES[name]], classes
    for method in ("generate", "sync_weights", "close"):
        assert callable(getattr(classes[0], method)), method


_FAKE_MODULE = """
import torch
from ppo_fast.spec import ROLLOUT_ENGINES
from ppo_fast.trainer.rollout import Batch


class FakeEngine:
    info = ROLLOUT_ENGINES["fake"]

    def __init__(self, setup):
        self.setup, self.synced = setup, 0

    def generate(self, tokenizer, prompts, *, max_new_tokens, temperature, top_p, top_k, min_p, greedy, device):
        ids = torch.ones(len(prompts), 1 + max_new_tokens, dtype=torch.long)
        return Batch(ids, torch.ones_like(ids, dtype=torch.bool), 1), torch.zeros(len(prompts), max_new_tokens)

    def sync_weights(self, policy):
        self.synced += 1
        return 0.0

    def close(self):
        pass


def start(setup):
    return FakeEngine(setup)
"""


def test_a_new_engine_is_one_module_and_one_registry_entry(tmp_path, monkeypatch):
    (tmp_path / "fake_engine.py").write_text(_FAKE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = RolloutEngine(name="fake", module="fake_engine", summary="a test's", logprobs=True, own_weights=True)
    monkeypatch.setitem(ROLLOUT_ENGINES, "fake", entry)
    cfg = TrainerConfig(rollout_engine="fake", rollout_correction="token_tis", min_p=0.1, top_p=0.9)
    cfg._validate_engine()  # its capabilities allow what the hf engine's refuse
    setup = EngineSetup(
        policy=torch.nn.Linear(1, 1),
        tokenizer=None,
        prompts=["a"],
        response_length=3,
        rows=2,
        device=torch.device("cpu"),
        cfg=cfg,
        output_dir=tmp_path,
        autocast=None,
        synced_gpus=False,
        log=print,
    )
    engine = engine_module.start("fake", setup)
    assert isinstance(engine, Engine) and engine.info is entry
    batch, logprobs = engine.generate(
        None, ["a", "b"], max_new_tokens=3, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, greedy=False, device="cpu"
    )
    assert batch.response_ids.shape == logprobs.shape == (2, 3)


@pytest.mark.parametrize(
    ("capability", "options", "match"),
    [
        ("logprobs", dict(rollout_correction="token_tis"), "rollout_correction .* needs --rollout-engine hf or vllm"),
        ("logprobs", dict(off_policy_loss="bypass"), "off_policy_loss .* needs --rollout-engine hf or vllm"),
        ("sleep_on", dict(vllm_sleep=True), "vllm_sleep .* needs --rollout-engine vllm"),
        ("truncation_order", dict(min_p=0.1, top_p=0.9), "min_p .* needs --rollout-engine vllm"),
        (
            "continues",
            dict(partial_rollouts=2, max_staleness=1),
            "partial_rollouts .* needs --rollout-engine hf or vllm",
        ),
        (
            "round_seconds",
            dict(partial_rollouts=2, partial_rollout_seconds=1.0, max_staleness=1),
            "partial_rollout_seconds .* needs --rollout-engine hf or vllm",
        ),
    ],
)
def test_options_are_checked_against_the_engines_capabilities(monkeypatch, capability, options, match):
    """An engine without the capability is refused naming the engines that have it; with it, accepted."""
    without = {"logprobs": False, "sleep_on": (), "truncation_order": ("top_p", "min_p", "top_k")}.get(
        capability, False
    )
    with_it = dataclasses.replace(ROLLOUT_ENGINES["vllm"], name="other", module="unused")
    monkeypatch.setitem(ROLLOUT_ENGINES, "other", dataclasses.replace(with_it, **{capability: without}))
    with pytest.raises(ConfigError, match=match):
        TrainerConfig(rollout_engine="other", **options)._validate_engine()
    monkeypatch.setitem(ROLLOUT_ENGINES, "other", with_it)
    TrainerConfig(rollout_engine="other", **options)._validate_engine()


# --------------------------------------------------------------------------- generation options


def test_stop_strings_end_each_response_at_the_token_that_completes_one():
    """--stop-strings on the HF engine: each response's text (the tokens its mask keeps) holds a stop
    string once, at its end, or none at all; nothing after it is kept, its behaviour log-probs are 0 there;
    the text matching the vLLM engine does afterwards finds the same ends."""
    import contextlib

    from ppo_fast.trainer import default_task
    from ppo_fast.trainer.rollout import decode_responses
    from ppo_fast.trainer.rollout_hf import HFEngine
    from ppo_fast.trainer.rollout_vllm import stop_string_mask

    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer, 0).eval()
    engine = HFEngine(model, autocast=contextlib.nullcontext, synced_gpus=False, stop_strings=["5", "=="], extra={})
    torch.manual_seed(torch.randint(1000, ()).item())
    sampling = dict(max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, greedy=False)
    batch, mu = engine.generate(tokenizer, ["12+34=", "50+6=", "70+18="] * 6, **sampling, device=torch.device("cpu"))
    stopped = 0
    for text in decode_responses(tokenizer, batch):
        ends = [s for s in ("5", "==") if text.endswith(s)]
        inside = [s for s in ("5", "==") if s in text[: len(text) - len(ends[0]) if ends else None]]
        assert not inside, f"{text!r} goes on past a stop string"
        stopped += bool(ends)
    assert stopped > 0, "no response met a stop string: the test shows nothing"
    assert bool((mu[~batch.response_mask] == 0).all())
    response, mask = batch.response_ids, batch.response_mask
    lengths = mask.sum(-1)
    assert torch.equal(stop_string_mask(tokenizer, response, lengths, ["5", "=="]) & mask, mask)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ('{"temperature": 0.5}', "which the trainer sets: use --temperature"),
        ('{"no_such_option": 1}', "no_such_option is not a GenerationConfig field"),
        ('{"cache_implementation": "nope"}', "Invalid .cache_implementation"),
    ],
)
def test_generation_kwargs_are_checked_against_the_engine_before_the_run(kwargs, match):
    from ppo_fast.trainer.rollout_hf import generation_keywords

    with pytest.raises(ConfigError, match=match):
        generation_keywords(TrainerConfig(generation_kwargs=kwargs).validate())
    keywords = generation_keywords(
        TrainerConfig(generation_kwargs='{"no_repeat_ngram_size": 3}', repetition_penalty=1.3)
    )
    assert keywords == {"repetition_penalty": 1.3, "no_repeat_ngram_size": 3}
