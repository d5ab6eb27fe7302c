"""Run under ``torchrun`` by tests/test_rollout_vllm.py: every rank drives its own vLLM engine.

Each rank joins the process group first (as a distributed trainer does), starts its engine
(vLLM's ``external_launcher`` executor), decodes its own prompts greedily, perturbs its policy,
syncs the weights and decodes again; both times the engine must agree with ``model.generate``.
Each rank that passes writes ``rank{R}.ok`` into the directory (ranks share stdout, so printed lines can interleave).
"""

import torch
import torch.distributed as dist
from test_rollout_vllm import same_batch, tiny_llama

from ppo_fast.trainer import default_task
from ppo_fast.trainer.rollout import generate
from ppo_fast.trainer.rollout_vllm import VLLMEngine


def main(model_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokenizer = default_task.build_tokenizer()
    policy = tiny_llama(tokenizer)
    engine = VLLMEngine(
        policy,
        model_dir=f"{model_dir}/rank{rank}",
        max_model_len=16,
        max_num_seqs=4,
        dtype=torch.float32,
        seed=0,
        gpu_memory_utilization=0.3,
        sleep=False,
    )
    prompts = [["12+34=", "56+78=", "90+11="], ["22+33=", "44+55="]][rank % 2]
    sampling = dict(max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=0, greedy=True)
    outputs = []
    for _ in range(2):
        engine_batch, _ = engine.generate(tokenizer, prompts, device=torch.device("cpu"), **sampling)
        hf_batch = generate(policy, tokenizer, prompts, **sampling)
        assert same_batch(engine_batch, hf_batch), f"rank {rank}: engine and model.generate disagree"
        outputs.append(hf_batch)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.05 * torch.randn_like(p))
        engine.sync_weights(policy)
    assert not same_batch(*outputs), f"rank {rank}: the perturbation did not change the greedy outputs"
    dist.barrier()
    with open(f"{model_dir}/rank{rank}.ok", "w") as marker:
        marker.write("ok\n")


if __name__ == "__main__":
    import sys

    main(sys.argv[1])
