"""Rollouts through Hugging Face's ``generate`` on the policy itself (``--rollout-engine hf``, the default):
no weights of its own to sync.  Its log-probs are the behaviour policy's, of the sampled tokens under the
distribution they were drawn from (temperature and truncation), read from the logits ``generate`` computes:
no forward of their own."""

from __future__ import annotations

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

import ppo_fast as pf
from ppo_fast.spec import ROLLOUT_ENGINES

from .engine import EngineSetup, engine_keywords
from .rollout import Batch, generate

# generate's keywords the trainer sets itself (the options that set them, where there is one).
_OWN_KEYWORDS = {
    "max_new_tokens": "--response-length",
    "max_length": "--response-length",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "do_sample": "--temperature",
    "stop_strings": "--stop-strings",
    "repetition_penalty": "--repetition-penalty",
    "pad_token_id": None,
    "eos_token_id": None,
    "num_return_sequences": "--group-size",
    "num_beams": None,
}


def generation_keywords(cfg) -> dict:
    """``--repetition-penalty`` and ``--generation-kwargs`` as ``generate``'s keywords, checked against
    transformers' ``GenerationConfig`` (``ConfigError`` naming the option, before the run starts)."""
    defaults = GenerationConfig()
    return engine_keywords(
        cfg,
        own=_OWN_KEYWORDS,
        known=lambda key: hasattr(defaults, key),
        build=lambda extra: GenerationConfig(do_sample=True, **extra).validate(strict=True),  # as training samples
        kind="a GenerationConfig field (--rollout-engine hf takes transformers' generation options)",
    )


class StopStrings(StoppingCriteria):
    """``--stop-strings`` for ``generate``: a row stops at the token that completes one of the strings in its
    decoded response, as vLLM matches them (on text, so any tokenizer works, where transformers'
    ``StopStringCriteria`` needs one that spells any word); it remembers how many tokens each row had
    generated then (``generate`` pads after that)."""

    def __init__(self, tokenizer, strings: list[str]):
        self.tokenizer, self.strings = tokenizer, strings
        # Tokens decoded each step: a string spans at most one token per character, plus a token either side.
        self.window = max(map(len, strings)) + 2
        self.start, self.stopped = 0, None

    def criteria(self, prompt_width: int) -> StoppingCriteriaList:
        """The criteria for one ``generate`` call whose prompts are ``prompt_width`` tokens wide."""
        self.start, self.stopped = prompt_width, None
        return StoppingCriteriaList([self])

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        generated = input_ids.shape[1] - self.start
        tails = self.tokenizer.batch_decode(input_ids[:, -min(self.window, generated) :], skip_special_tokens=True)
        done = torch.tensor([any(s in tail for s in self.strings) for tail in tails], device=input_ids.device)
        if self.stopped is None:
            self.stopped = torch.full(done.shape, torch.iinfo(torch.long).max, device=done.device)
        self.stopped = torch.where(done, torch.clamp(self.stopped, max=generated), self.stopped)
        return done

    def mask(self, response: torch.Tensor) -> torch.Tensor:
        """True at the response tokens up to and including each row's stop string."""
        if self.stopped is None:
            return torch.ones_like(response, dtype=torch.bool)
        return torch.arange(response.shape[1], device=response.device) < self.stopped[:, None]


class TimeUp(StoppingCriteria):
    """Ends every row at the token just sampled once ``time_up()`` says so (``--partial-rollout-seconds``): the
    rows not ended by their EOS are continued in the next round.  Asked after each token, so a round
    samples at least one."""

    def __init__(self, time_up):
        self.time_up = time_up

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), bool(self.time_up()), dtype=torch.bool, device=input_ids.device)


class BehaviourLogprobs(LogitsProcessor):
    """Records each sampled token's log-prob under the sampling distribution, ``pf.token_logprobs`` of the
    step's logits at ``sampling``'s temperature and truncation (the log-prob ops' order, which Hugging
    Face's agrees with where the options allow this engine: ``TrainerConfig._validate_engine``).

    ``generate`` applies the processors it is given before its own temperature and truncation warpers, so
    this one sees the logits after any of the model's generation-config processors and leaves them as they
    are.  The token drawn from a step's logits is the last column of the next call's ``input_ids`` (or of
    the output, for the last step), so one step's logits are held at a time."""

    def __init__(self, *, temperature: float, top_k: int, top_p: float, min_p: float):
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        self.pending: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._score_pending(input_ids[:, -1])
        self.pending = scores.detach().float().clone()  # the warpers after this one must not change it
        return scores

    def _score_pending(self, tokens: torch.Tensor) -> None:
        if self.pending is not None:
            self.steps.append(pf.token_logprobs(self.pending, tokens, **self.sampling))
            self.pending = None

    def logprobs(self, batch: Batch) -> torch.Tensor:
        """``[B, R]`` float32 log-probs of ``batch``'s response tokens, 0 after each response.  ``generate``
        may have run steps it then dropped (a deferred stop check): those are not the response's."""
        response = batch.response_ids
        width = response.shape[1]
        if len(self.steps) < width:
            self._score_pending(response[:, len(self.steps)])
        if len(self.steps) < width:
            raise RuntimeError(f"generate returned {width} response tokens but sampled {len(self.steps)} steps")
        mu = torch.stack(self.steps[:width], 1) if width else response.new_zeros(response.shape, dtype=torch.float32)
        return mu.masked_fill(~batch.response_mask, 0.0)


class HFEngine:
    """``policy.generate`` with the KV cache (``rollout.generate``), under the run's autocast; with
    sharded weights every rank runs the same number of forward passes (``synced_gpus``)."""

    info = ROLLOUT_ENGINES["hf"]

    def __init__(self, policy: torch.nn.Module, *, autocast, synced_gpus: bool, stop_strings=(), extra=None):
        self.policy, self.autocast, self.synced_gpus = policy, autocast, synced_gpus
        self.stop_strings, self.extra, self.stop = list(stop_strings), extra or {}, None

    def generate(
        self,
        tokenizer,
        prompts: list[str],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int = 0,
        min_p: float = 0.0,
        greedy: bool,
        device: torch.device,
        prefixes: list[list[int]] | None = None,
        time_up=None,
    ) -> tuple[Batch, torch.Tensor | None]:
        """``(batch, the behaviour log-probs [B, R] of the response tokens, 0 after each response)`` on the
        policy's device (``device`` is where the policy already is); ``greedy``: ``(batch, None)``;
        ``prefixes``: each row's response so far, continued (``rollout.generate``); ``time_up()``: True ends
        the generation at the token just sampled (``TimeUp``)."""
        if time_up is not None and self.synced_gpus:
            raise ValueError("time_up: ranks in step (synced_gpus) would stop at different tokens")
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
        recorder = None if greedy else BehaviourLogprobs(**sampling)
        if self.stop_strings and self.stop is None:  # built once: it tabulates the tokenizer's vocabulary
            self.stop = StopStrings(tokenizer, self.stop_strings)
        with self.autocast():
            batch = generate(
                self.policy,
                tokenizer,
                prompts,
                max_new_tokens=max_new_tokens,
                synced_gpus=self.synced_gpus,
                greedy=greedy,
                logits_processor=None if recorder is None else LogitsProcessorList([recorder]),
                stop=self.stop,
                extra=self.extra,
                prefixes=prefixes,
                criteria=None if time_up is None else [TimeUp(time_up)],
                **sampling,
            )
        return batch, None if recorder is None else recorder.logprobs(batch)

    def sync_weights(self, policy) -> float:
        """Nothing to do: it generates with the policy itself."""
        return 0.0

    def close(self) -> None:
        pass


def start(setup: EngineSetup) -> HFEngine:
    cfg = setup.cfg
    return HFEngine(
        setup.policy,
        autocast=setup.autocast,
        synced_gpus=setup.synced_gpus,
        stop_strings=cfg.stop_string_list(),
        extra=generation_keywords(cfg),
    )
