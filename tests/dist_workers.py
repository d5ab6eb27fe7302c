"""Worker processes of tests/test_distributed.py (spawned with torch.multiprocessing; not a test module).

``one_update`` runs one PPO optimizer step (one minibatch, two micro-batches of uneven token
counts) on this rank's half of a fixed batch of rollouts, with advantages whitened over all
ranks, and returns the loss, the gradients and the updated weights as full tensors.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ppo_fast.trainer import TrainerConfig, default_task, lora, rollout
from ppo_fast.trainer.distributed import SINGLE, Parallel, shutdown
from ppo_fast.trainer.estimate import EstimateOptions, estimate
from ppo_fast.trainer.models import build_critic, frozen_reference
from ppo_fast.trainer.rollout import generate, score_old_and_ref
from ppo_fast.trainer.update import Experience, ppo_losses, ppo_update

ROWS = 8  # the whole batch; world 2 gives each rank 4


# Micro-batches of at most this many tokens in the "token-budget" variant (a row has 7 to 10).
TOKEN_BUDGET = 16


def config(agg: str, variant: str = "plain") -> TrainerConfig:
    # The entropy bonus is a token mean whatever agg is: with a seq-mean-* mode it is left out here.
    budget = TOKEN_BUDGET if variant == "token-budget" else None
    return TrainerConfig(
        num_ppo_epochs=1,
        num_mini_batches=1,
        gradient_accumulation_steps=1 if budget else 2,
        max_tokens_per_micro_batch=budget,
        max_grad_norm=0.5,
        agg=agg,
        vf_coef=0.5,
        entropy_coef=0.01 if agg == "token-mean" else 0.0,
    )


def rollouts(seed: int):
    """The same models and rollouts on every rank (seeded), the critic separate."""
    tokenizer = default_task.build_tokenizer()
    policy = default_task.build_model(tokenizer, seed).eval()
    reference = frozen_reference(policy)
    with torch.no_grad():  # the reference a little away from the policy: a non-zero KL
        for p in reference.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    critic = build_critic(policy, "separate")
    torch.manual_seed(seed)
    prompts = [default_task.prompt(10 + 7 * i, 30 + 5 * i) for i in range(ROWS)]
    batch = generate(policy, tokenizer, prompts, max_new_tokens=4, temperature=1.0, top_p=1.0, greedy=False)
    scores = torch.linspace(-1.0, 2.0, ROWS)
    return policy, reference, critic, batch, scores


def one_update(parallel: Parallel, seed: int, agg: str, variant: str = "plain") -> dict:
    """``variant``: "plain"; "lora": LoRA on the policy and the critic's backbone (only they and the value
    head train); "token-budget": micro-batches by ``TOKEN_BUDGET`` tokens (the ranks' counts may differ)."""
    cfg = config(agg, variant)
    policy, reference, critic, batch, scores = rollouts(seed)
    if variant == "token-budget":  # the first half's responses cut to one token: rank 0 gets fewer micro-batches
        mask = batch.attention_mask.clone()
        mask[: ROWS // 2, batch.prompt_width + 1 :] = False
        batch = rollout.Batch(batch.input_ids, mask, batch.prompt_width)
    if variant == "lora":
        options = TrainerConfig(lora_r=4, lora_alpha=8.0)
        lora.attach(options, policy)
        lora.attach(options, critic.backbone)
        with torch.no_grad():  # B starts at 0 (then A's gradient is 0): give both a gradient
            for name, p in [*policy.named_parameters(), *critic.named_parameters()]:
                if ".lora_B." in name:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(seed))
    share = ROWS // parallel.world_size
    mine = torch.arange(parallel.rank * share, (parallel.rank + 1) * share)
    batch, scores = batch.rows(mine), scores[mine]
    old, ref, values = score_old_and_ref(policy, reference, critic, batch, temperature=1.0)
    est = estimate(
        scores,
        old,
        ref,
        values,
        batch.response_mask,
        EstimateOptions(
            advantage_method="gae",
            kl_coef=0.1,
            kl_estimator="k1",
            kl_in_reward=True,
            gamma=1.0,
            lam=0.95,
            whiten=True,
            group_size=1,
        ),
        whitener=parallel.masked_whiten,
    )
    exp = Experience(batch=batch, old_logprobs=old, advantages=est.advantages, old_values=values, returns=est.returns)
    train_policy, train_critic = parallel.prepare(policy, critic, reference)
    named = [*policy.named_parameters(), *((f"critic.{n}", p) for n, p in critic.named_parameters())]
    names, params = zip(*[(n, p) for n, p in named if p.requires_grad])
    # The loss over the whole batch before the step: this rank's share of the global token-mean.
    with torch.no_grad():
        weight = parallel.micro_batch_weights([batch.response_mask], agg)[0]
        loss = parallel.all_sum(ppo_losses(train_policy, train_critic, exp, cfg)[0] * weight) / parallel.world_size
    optimizer = torch.optim.SGD(params, lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    rollout._fallbacks_logged.clear()
    ppo_update(train_policy, train_critic, optimizer, scheduler, exp, cfg, step=1, parallel=parallel)

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    return {
        "loss": loss.item(),
        "advantages": parallel_gather(parallel, est.advantages),
        "weights": {n: full(p.detach()).clone() for n, p in zip(names, params)},
        "grads": {n: full(p.grad).clone() for n, p in zip(names, params)},
        "logits_fallbacks": sorted(rollout._fallbacks_logged),  # why the update did not use the fused head
    }


def parallel_gather(parallel: Parallel, x: torch.Tensor) -> torch.Tensor:
    if not parallel.active:
        return x
    parts = [torch.empty_like(x) for _ in range(parallel.world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def reference_update(seed: int, agg: str, variant: str = "plain") -> dict:
    """The same step in one process with the whole batch."""
    return one_update(SINGLE, seed, agg, variant)


AGGS = ("token-mean", "seq-mean-token-mean")
# (mode, agg, variant) of the equivalence step: every agg in both modes, LoRA and a token budget in both.
CASES = [(mode, agg, "plain") for mode in ("ddp", "fsdp") for agg in AGGS] + [
    (mode, "token-mean", variant) for variant in ("lora", "token-budget") for mode in ("ddp", "fsdp")
]


def equivalence(rank: int, world_size: int, init_file: str, out: str, seed: int) -> None:
    """Entry point of ``torch.multiprocessing.spawn``: the step under DDP and under FSDP2, for each of ``AGGS``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    results = {
        (mode, agg, variant): one_update(Parallel(rank=rank, world_size=world_size, mode=mode), seed, agg, variant)
        for mode, agg, variant in CASES
    }
    if rank == 0:
        torch.save(results, out)
    del results
    shutdown()


def eval_shards(rank: int, world_size: int, init_file: str, out_dir: str, out: str) -> None:
    """Entry point of ``torch.multiprocessing.spawn``: the built-in job's held-out evaluation under
    DDP, each rank counting the prompts it decoded; rank 0 saves the metrics and the counts."""
    from ppo_fast.trainer import evaluation

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    decoded = []
    original = evaluation.generate
    evaluation.generate = lambda model, tokenizer, prompts, **kw: (
        decoded.append(len(prompts)) or original(model, tokenizer, prompts, **kw)
    )
    trainer = eval_trainer(out_dir)
    metrics = trainer.evaluate_all(trainer.policy)
    counts = trainer.parallel.gather_objects(sum(decoded))
    if rank == 0:
        torch.save({"metrics": metrics, "counts": counts}, out)
    del trainer
    shutdown()


def response_length(prompts: list[str], responses: list[str]) -> list[float]:
    """A reward that varies between responses of a barely trained model (unlike the addition's)."""
    return [len(r) / 8 for r in responses]


def eval_trainer(out_dir: str):
    """The built-in model with 37 held-out prompts (not a multiple of the world size), their
    answers, and ``response_length`` as the reward."""
    from ppo_fast.trainer import PPOTrainer

    cfg = TrainerConfig(
        output_dir=out_dir,
        steps=1,
        batch_size=8,
        num_mini_batches=1,
        num_ppo_epochs=1,
        sample_every=0,
        sft_steps=10,
        eval_size=37,
        parallel="ddp",
    )
    held_out = default_task.prompts(cfg)[1]
    answers = [str(sum(int(x) for x in p.rstrip("=").split("+"))) for p in held_out]
    return PPOTrainer(cfg, reward_fn=response_length, eval_prompts=held_out, eval_answers=answers, log=lambda _: None)


def under_torchrun(out: str, seed: int) -> None:
    """The equivalence step in a process group started by ``torchrun`` (``env://``, one process
    per node), and each rank's shard of the built-in task's prompts; rank 0 saves both."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = {
        (mode, agg): one_update(Parallel(rank=rank, world_size=world_size, mode=mode), seed, agg)
        for mode in ("ddp", "fsdp")
        for agg in AGGS
    }
    parallel = Parallel(rank=rank, world_size=world_size)
    count = len(default_task.prompts(TrainerConfig(batch_size=6, eval_size=0))[0])
    shards = parallel.gather_objects(list(parallel.shard(count)))
    if rank == 0:
        torch.save({"results": results, "shards": shards, "count": count}, out)
    # Every rank's last sends delivered before any rank tears gloo down: over a slow link (the tbf
    # test) a rank that tore down with its gather still in flight died with "terminate called".
    dist.barrier()
    del results
    shutdown()


def logged_length(prompts: list[str], responses: list[str]) -> list[float]:
    """``response_length``, each call's prompts and responses appended to ``$PPO_FAST_REWARD_LOG`` (JSON lines,
    with the calling process)."""
    import json

    with open(os.environ["PPO_FAST_REWARD_LOG"], "a") as log:
        log.write(json.dumps({"pid": os.getpid(), "prompts": prompts, "responses": responses}) + "\n")
    return response_length(prompts, responses)


def async_ranks(rank: int, world_size: int, init_file: str, out_dir: str, out: str) -> None:
    """Entry point of ``torch.multiprocessing.spawn``: three GRPO steps of the built-in job under FSDP2 with
    ``--max-staleness 1`` (rank 0's producer rewards with ``logged_length``).  Each rank records, at each step's
    end, the row it returned, the rollouts it trained on and its policy version; rank 0 saves every rank's
    records, the producer's staging weights and the policy's full weights before and after."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from ppo_fast.trainer import PPOTrainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    seen = []

    class Record:
        def on_step_end(self, trainer, row):
            seen.append(
                dict(row=row, samples=trainer.run.last_samples, version=trainer.run.policy_version, pid=os.getpid())
            )

    cfg = TrainerConfig(
        output_dir=out_dir,
        steps=3,
        batch_size=8,
        group_size=2,
        advantage_method="grpo",
        num_mini_batches=1,
        num_ppo_epochs=1,
        learning_rate=1e-3,
        sample_every=0,
        sft_steps=10,
        eval_size=0,
        parallel="fsdp",
        max_staleness=1,
    )
    trainer = PPOTrainer(cfg, reward_fn=logged_length, callbacks=[Record()], log=lambda _: None)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    before = get_model_state_dict(trainer.policy, options=options)
    trainer.train()
    after = get_model_state_dict(trainer.policy, options=options)
    records = trainer.run.parallel.gather_objects(seen)
    if rank == 0:
        staging = {name: t.clone() for name, t in trainer.run.source.local.staging.items()}
        torch.save(dict(records=records, staging=staging, before=before, after=after, pid=os.getpid()), out)
    dist.barrier()
    del trainer
    shutdown()


if __name__ == "__main__":
    import sys

    under_torchrun(sys.argv[1], int(sys.argv[2]))
