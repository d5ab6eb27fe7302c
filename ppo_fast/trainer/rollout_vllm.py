"""Rollouts through vLLM (``--rollout-engine vllm``): a generation engine in the trainer's process.

The engine is built from the policy's config with dummy weights and gets the policy's
weights through vLLM's in-place reload (the worker's ``reload_weights``), the same call
that syncs them after every update: no restart, no checkpoint on disk.  It samples with
the trainer's settings (temperature, top-p, top-k, max tokens, stop at EOS) from the
trainer's own prompt token ids, and returns the log-probs of the sampled tokens under the
distribution it sampled from (vLLM's ``processed_logprobs``: after temperature and
top-k/top-p; with top-p 1 and top-k 0 the same quantity as the trainer's log-probs).

One engine per process.  A single process runs vLLM's in-process executor (``uni`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the weights are handed over by reference); under
``torchrun`` every rank drives its own engine (tensor parallel size 1, data parallel over
the ranks) through vLLM's ``external_launcher`` executor, which joins the ranks' process
group, each rank with its own sampling seed.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import torch

from ppo_fast.spec import ROLLOUT_ENGINES

from . import lora, run_folder
from .config import ConfigError
from .engine import EngineSetup, engine_keywords
from .rollout import Batch, batch_from_responses, encode_continuations, encode_prompts

INSTALL_HINT = ROLLOUT_ENGINES["vllm"].install_hint
# On CPU the KV cache is sized for the job (vLLM's default reserves a fraction of the machine's
# memory); each sequence may start a new cache block, hence the slack per sequence.
CPU_KV_CACHE_SLACK_TOKENS = 256
CPU_KV_CACHE_MIN_BYTES = 32 << 20


def check_installed() -> None:
    """``ConfigError`` when vLLM cannot be imported."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"--rollout-engine vllm: vllm is not installed ({INSTALL_HINT})")


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _kv_cache_bytes(config, sequences: int, max_model_len: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for ``sequences`` sequences of ``max_model_len`` tokens (with slack)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize
    return max(CPU_KV_CACHE_MIN_BYTES, per_token * sequences * (max_model_len + CPU_KV_CACHE_SLACK_TOKENS))


class VLLMEngine:
    """A ``vllm.LLM`` that generates the trainer's rollouts and follows the policy's weights.

    ``sleep`` (GPU only) puts the engine to sleep after each generation (weights offloaded
    to the CPU, KV cache freed) and wakes it in :meth:`sync_weights`.
    """

    info = ROLLOUT_ENGINES["vllm"]

    def __init__(
        self,
        policy,
        *,
        model_dir: str | Path,
        max_model_len: int,
        max_num_seqs: int,
        dtype: torch.dtype,
        seed: int,
        gpu_memory_utilization: float,
        sleep: bool,
        stop_strings: list[str] = (),
        extra: dict | None = None,
    ):
        check_installed()
        self.stop_strings, self.extra = list(stop_strings), extra or {}
        self.stepped = 0  # the generations _generate_until ran (its request ids)
        distributed = _world_size() > 1
        if not distributed:  # the worker in this process: weights are synced by reference
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        device = next(policy.parameters()).device
        policy.config.save_pretrained(model_dir)  # the architecture only: the weights come from sync_weights
        options = {}
        if device.type == "cpu":
            options["kv_cache_memory_bytes"] = _kv_cache_bytes(policy.config, max_num_seqs, max_model_len, dtype)
            options["enforce_eager"] = True  # torch.compile of the model would take minutes on a CPU
        self.sleep = sleep
        start = time.perf_counter()
        self.llm = LLM(
            model=str(model_dir),
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype=str(dtype).removeprefix("torch."),
            seed=seed + int(os.environ.get("RANK", "0")),
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            logprobs_mode="processed_logprobs",
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=sleep,
            distributed_executor_backend="external_launcher" if distributed else "uni",
            **options,
        )
        self.start_s = time.perf_counter() - start
        self.sync_weights(policy)

    @torch.no_grad()
    def sync_weights(self, policy) -> float:
        """Load the policy's current weights into the engine in place; returns the seconds it took."""
        start = time.perf_counter()
        if self.sleep:
            self.llm.wake_up(tags=["weights"])
        # Checkpoint names, which vLLM's loaders map; sharded (DTensor) weights are gathered on every rank.
        state = {name: w.full_tensor() if hasattr(w, "full_tensor") else w for name, w in policy.state_dict().items()}
        if any(".lora_" in name for name in state):  # LoRA: the engine serves the base with the adapters merged
            state = lora.merged_state_dict(policy, state)
        weights = list(state.items())
        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True))
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        if self.sleep:
            self.llm.wake_up(tags=["kv_cache"])
        return time.perf_counter() - start

    def _generate_until(self, requests: list, params, time_up) -> list:
        """Each request's completion, generated step by step through the ``LLM``'s engine (``generate`` runs
        every request to its end) until ``time_up()``, read after each step once every request has sampled a
        token (so each round samples at least one); then the unfinished ones are aborted, keeping what they
        sampled, the log-probs of those tokens with them."""
        from vllm.sampling_params import RequestOutputKind

        params = params.clone()
        params.output_kind = RequestOutputKind.CUMULATIVE  # each step's output holds every token so far
        engine, self.stepped = self.llm.llm_engine, self.stepped + 1
        ids = [f"ppo-fast-{self.stepped}-{row}" for row in range(len(requests))]
        for request_id, request in zip(ids, requests):
            engine.add_request(request_id, request, params)
        latest = {}
        while engine.has_unfinished_requests():
            latest |= {out.request_id: out for out in engine.step()}
            started = len(latest) == len(ids) and all(out.outputs[0].token_ids for out in latest.values())
            if started and time_up():
                engine.abort_request([i for i in ids if not latest[i].finished])
                break
        return [latest[i].outputs[0] for i in ids]

    def close(self) -> None:
        """Shut the engine down (its worker and its process groups); it cannot generate afterwards."""
        self.llm.llm_engine.engine_core.shutdown()

    @torch.no_grad()
    def generate(
        self,
        tokenizer,
        prompts: list[str],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        min_p: float = 0.0,
        greedy: bool,
        device: torch.device,
        prefixes: list[list[int]] | None = None,
        time_up=None,
    ) -> tuple[Batch, torch.Tensor]:
        """``(batch, engine log-probs [B, R] of the response tokens, 0 after each response)``.

        The same batch layout as ``rollout.generate``: left-padded prompts, responses up
        to and including their EOS, padding after.  ``prefixes``: each row's response so far
        (``--partial-rollouts``), continued: the engine's prompt is the prompt's tokens then the
        prefix's, so the new tokens are sampled, and their log-probs taken, given both.  ``time_up()``
        (``--partial-rollout-seconds``): read after each engine step once every row has a token; True ends
        every row at the tokens it has (``_generate_until``).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if prefixes is None:
            enc = encode_prompts(tokenizer, prompts, "cpu")
        else:
            enc = encode_continuations(tokenizer, prompts, prefixes, "cpu")
        params = SamplingParams(
            temperature=0.0 if greedy else temperature,
            top_p=1.0 if greedy else top_p,
            top_k=0 if greedy else top_k,
            min_p=0.0 if greedy else min_p,
            max_tokens=max_new_tokens,
            stop_token_ids=[tokenizer.eos_token_id],
            logprobs=0,
            detokenize=False,
            **self.extra,
        )
        requests = [
            TokensPrompt(prompt_token_ids=ids[keep].tolist())
            for ids, keep in zip(enc["input_ids"], enc["attention_mask"].bool())
        ]
        if time_up is None:
            completions = [out.outputs[0] for out in self.llm.generate(requests, params, use_tqdm=False)]
        else:
            completions = self._generate_until(requests, params, time_up)
        if self.sleep:
            self.llm.sleep(level=1)
        width = max(len(c.token_ids) for c in completions)
        response = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(len(prompts), width, dtype=torch.float32)
        lengths = torch.zeros(len(prompts), dtype=torch.long)
        for row, c in enumerate(completions):
            ids = list(c.token_ids)
            response[row, : len(ids)] = torch.tensor(ids)
            logprobs[row, : len(ids)] = torch.tensor([step[token].logprob for token, step in zip(ids, c.logprobs)])
            lengths[row] = len(ids)
        mask = torch.arange(width) < lengths[:, None]
        if self.stop_strings:  # matched on the text afterwards (the engine holds no tokenizer)
            mask &= stop_string_mask(tokenizer, response, lengths, self.stop_strings)
            logprobs = logprobs.masked_fill(~mask, 0.0)
        batch = batch_from_responses(enc, response, mask, tokenizer.pad_token_id)
        return Batch(batch.input_ids.to(device), batch.attention_mask.to(device), batch.prompt_width), logprobs.to(
            device
        )


# SamplingParams' fields the engine sets itself (the options that set them, where there is one).
_OWN_PARAMS = {
    "n": "--group-size",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "max_tokens": "--response-length",
    "stop": "--stop-strings",
    "stop_token_ids": None,
    "logprobs": None,
    "detokenize": None,
    "repetition_penalty": "--repetition-penalty",
}


def sampling_keywords(cfg) -> dict:
    """``--repetition-penalty`` and ``--generation-kwargs`` as ``SamplingParams`` keywords, checked against
    vLLM's ``SamplingParams`` (``ConfigError`` naming the option, before the run starts)."""
    from vllm import SamplingParams

    fields = set(getattr(SamplingParams, "__struct_fields__", ())) or set(SamplingParams.__annotations__)
    return engine_keywords(
        cfg,
        own=_OWN_PARAMS,
        known=fields.__contains__,
        build=lambda extra: SamplingParams(**extra),
        kind="a SamplingParams field (--rollout-engine vllm takes vLLM's sampling options)",
    )


def stop_string_mask(tokenizer, response: torch.Tensor, lengths: torch.Tensor, strings: list[str]) -> torch.Tensor:
    """True at each row's response tokens up to and including the token whose text completes the first stop
    string (all of them where none occurs): the shortest prefix whose decoded text holds one, by bisection
    (holding one only grows with the prefix)."""
    cut = lengths.clone()

    def holds(row: int, n: int) -> bool:
        text = tokenizer.decode(response[row, :n], skip_special_tokens=True)
        return any(s in text for s in strings)

    for row in range(response.shape[0]):
        low, high = 1, int(lengths[row])
        if high == 0 or not holds(row, high):
            continue
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if holds(row, middle) else (middle + 1, high)
        cut[row] = low
    return torch.arange(response.shape[1]) < cut[:, None]


def start(setup: EngineSetup) -> VLLMEngine:
    """The vLLM engine, holding the policy's weights (started before the PPO phase is seeded:
    vLLM seeds torch's generator when it starts)."""
    cfg = setup.cfg
    longest = max(len(ids) for ids in setup.tokenizer(setup.prompts).input_ids)
    cuda_bf16 = setup.device.type == "cuda" and cfg.bf16
    dtype = torch.bfloat16 if cuda_bf16 else next(setup.policy.parameters()).dtype
    engine = VLLMEngine(
        setup.policy,
        model_dir=setup.output_dir / run_folder.VLLM_MODEL_DIR,
        max_model_len=longest + setup.response_length,
        max_num_seqs=setup.rows,
        dtype=dtype,
        seed=cfg.seed,
        gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        sleep=cfg.vllm_sleep,
        stop_strings=cfg.stop_string_list(),
        extra=sampling_keywords(cfg),
    )
    setup.log(f"vLLM engine ({dtype}) started in {engine.start_s:.1f}s")
    return engine
