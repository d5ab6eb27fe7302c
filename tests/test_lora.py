"""LoRA (--lora-r): adapters on a frozen base, the reference as the policy with its adapters off,
checkpoints of the adapters only, an exact resume, the adapter folder and the merged export."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from test_trainer import _comparable
from transformers import AutoModelForCausalLM

from ppo_fast.trainer import ConfigError, PPOTrainer, TrainerConfig, checkpoint, default_task, lora, saved
from ppo_fast.trainer.metrics import METRICS_FILE, read_metrics
from ppo_fast.trainer.report import plot_title
from ppo_fast.trainer.rollout import forward, generate, scores_through_fused_head

peft = pytest.importorskip("peft")


@pytest.fixture
def tiny(tiny_config):
    """tiny_config with adapters (at a learning rate they learn at in two steps)."""
    return functools.partial(tiny_config, learning_rate=1e-2, lora_r=4, lora_alpha=8.0)


def _model_and_batch(seed: int):
    tokenizer = default_task.build_tokenizer()
    policy = default_task.build_model(tokenizer, seed).eval()
    prompts = [default_task.prompt(3 + 11 * i, 40 + 7 * i) for i in range(5)]
    batch = generate(policy, tokenizer, prompts, max_new_tokens=4, temperature=1.0, top_p=1.0, greedy=False)
    return policy, batch


def test_adapters_off_is_the_base_bitwise_and_merged_weights_give_the_adapted_outputs():
    seed = torch.randint(1000, ()).item()
    policy, batch = _model_and_batch(seed)
    base = AutoModelForCausalLM.from_config(policy.config).eval()
    base.load_state_dict(policy.state_dict())
    adapters = lora.attach(TrainerConfig(lora_r=4, lora_alpha=16.0), policy)
    trainable = {name for name, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    with torch.no_grad():  # adapters that change the outputs (B starts at 0)
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want, _, _ = forward(base, None, batch, temperature=1.0)
        with adapters.disable_adapter():
            off, _, _ = forward(policy, None, batch, temperature=1.0)
        on, _, _ = forward(policy, None, batch, temperature=1.0)
    assert torch.equal(off, want)  # bitwise: the reference costs no copy and no rounding
    assert (on - want).abs().max() > 1e-3
    # The weights the rollout engine and --lora-save-merged get: the base's names, W + scale * B @ A.
    merged = lora.merged_state_dict(policy)
    assert merged.keys() == base.state_dict().keys()
    base.load_state_dict(merged)
    with torch.no_grad():
        via_merged, _, _ = forward(base, None, batch, temperature=1.0)
    torch.testing.assert_close(via_merged, on, rtol=0, atol=2e-5)


def test_a_target_that_names_no_linear_layer_is_refused_naming_the_layers_there_are():
    policy, _ = _model_and_batch(0)
    with pytest.raises(ConfigError, match=r"--lora-target-modules q_proj: .*named c_attn, c_fc, c_proj"):
        lora.attach(TrainerConfig(lora_r=4, lora_target_modules="q_proj"), policy)
    policy, _ = _model_and_batch(0)
    with pytest.raises(ConfigError, match=r"wte is a Embedding; only linear layers are adapted"):
        lora.attach(TrainerConfig(lora_r=4, lora_target_modules="c_attn,wte"), policy)


def test_a_lora_run_trains_adapters_only_checkpoints_them_resumes_exactly_and_exports(tmp_path, tiny):
    straight = tiny("straight", steps=3, lora_save_merged=True)
    trainer = PPOTrainer(straight)
    assert trainer.reference is trainer.policy  # no copy: the policy with its adapters off
    base_before = {name: p.detach().clone() for name, p in trainer.policy.named_parameters() if not p.requires_grad}
    trainer.train()
    base_after = dict(trainer.policy.named_parameters())
    assert all(torch.equal(base_after[name], value) for name, value in base_before.items())
    rows = read_metrics(Path(straight.output_dir) / METRICS_FILE)
    assert [r["policy/ratio_dev_at_start"] for r in rows] == [0.0] * 3  # on-policy with LoRA on

    final = checkpoint.latest(Path(straight.output_dir))
    policy_dir = final / checkpoint.POLICY_DIR
    assert (policy_dir / "adapter_model.safetensors").is_file() and not (policy_dir / "model.safetensors").exists()
    config = json.loads((policy_dir / "adapter_config.json").read_text())
    assert config["r"] == 4 and Path(config["base_model_name_or_path"]) == (tmp_path / "straight" / "warmup")
    trainable = {name for model in (trainer.policy, trainer.critic) for name, p in model.named_parameters()}
    trainable = {n for n in trainable if ".lora_" in n or n.startswith("head.")}
    critic_state = torch.load(final / checkpoint.CRITIC_FILE, weights_only=True)
    assert set(critic_state) == set(lora.trainable_state(trainer.critic)) and set(critic_state) <= trainable
    state = checkpoint.load_state(final)
    optimized = sum(len(group["params"]) for group in state.optimizer["param_groups"])
    assert optimized == sum(p.requires_grad for m in (trainer.policy, trainer.critic) for p in m.parameters())

    # The adapter folder loads with PEFT, its base found from it; the merged export gives the same outputs.
    by_peft = peft.AutoPeftModelForCausalLM.from_pretrained(policy_dir).eval()
    merged = AutoModelForCausalLM.from_pretrained(final / checkpoint.MERGED_DIR).eval()
    ids = trainer.tokenizer(["12+34=", "7+5="], return_tensors="pt", padding=True)
    with torch.no_grad():
        ours = trainer.policy(**ids).logits
        torch.testing.assert_close(by_peft(**ids).logits, ours, rtol=0, atol=0)
        torch.testing.assert_close(merged(**ids).logits, ours, rtol=1e-5, atol=1e-5)
    # ppo-fast eval finds the base through the adapter folder.
    scores = saved.evaluate(str(tmp_path / "straight"), device="cpu")
    assert scores["prompts"] == 16 and 0.0 <= scores["eval/score"] <= 1.0

    # Two steps, then --resume to three: the same run, bit for bit.
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "straight" / "warmup", resumed_dir / "warmup")
    PPOTrainer(tiny("resumed", steps=2)).train()
    with pytest.raises(ConfigError, match=r"trained with --lora-r 4 .* resume with --lora-r 4"):
        PPOTrainer(tiny("resumed", steps=3, resume=True, lora_r=8))
    PPOTrainer(tiny("resumed", steps=3, resume=True)).train()
    want, got = _comparable(rows[2]), _comparable(read_metrics(resumed_dir / METRICS_FILE)[2])
    if trainer.device.type == "cpu":
        assert got == want
    else:  # on a GPU, some kernels accumulate in a run-dependent order
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_modules_to_save_trains_the_head_whole_through_the_fused_head_and_the_reference_keeps_the_base(tiny):
    """--lora-modules-to-save lm_head: the head's trained copy moves, scored through the fused head; the
    reference (adapters off) reads the base's head; the checkpoint's adapter folder holds the copy."""
    cfg = tiny("head", steps=2, lora_modules_to_save="lm_head", entropy_coef=0.05, lora_save_merged=True)
    trainer = PPOTrainer(cfg)
    head = trainer.policy.get_output_embeddings()
    base = head.original_module.weight.detach().clone()
    assert scores_through_fused_head(trainer.train_policy, trainer.device)
    assert ", LoRA r4: " in plot_title(trainer.run) and " trainable)" in plot_title(trainer.run)
    trainer.train()
    trained = head.modules_to_save[lora.ADAPTER_NAME].weight
    assert torch.equal(head.original_module.weight, base) and not torch.equal(trained, base)
    assert head.weight is trained
    with trainer.adapters.disable_adapter():
        assert head.weight is head.original_module.weight
    saved_state = lora.read_adapter(checkpoint.latest(Path(cfg.output_dir)) / checkpoint.POLICY_DIR)
    head_keys = [key for key in saved_state if "lm_head" in key]
    assert head_keys and torch.equal(saved_state[head_keys[0]], trained.detach())
    assert torch.equal(lora.merged_state_dict(trainer.policy)["lm_head.weight"], trained.detach())
    # The merged export holds the trained head (not tied back to the base's embeddings): the same logits.
    merged = AutoModelForCausalLM.from_pretrained(checkpoint.latest(Path(cfg.output_dir)) / checkpoint.MERGED_DIR)
    ids = trainer.tokenizer(["12+34=", "7+5="], return_tensors="pt", padding=True)
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(**ids).logits, trainer.policy(**ids).logits, rtol=1e-5, atol=1e-5)


def test_lora_without_peft_is_one_line_before_any_model_loads(tmp_path, tiny, monkeypatch):
    real = lora.importlib.util.find_spec
    monkeypatch.setattr(lora.importlib.util, "find_spec", lambda name: None if name == "peft" else real(name))
    with pytest.raises(ConfigError, match=r"--lora-r: PEFT is not installed; pip install peft"):
        PPOTrainer(tiny())
    assert not (tmp_path / "run").exists()  # refused before the run folder or the warm-up model
