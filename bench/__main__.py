"""``python -m bench [suite] [options]``: run one benchmark suite; without a suite, ``ops``.

``python -m bench --help`` lists the suites; ``python -m bench <suite> --help`` gives a
suite's own options.  Each suite is a module of this package with a ``main(argv)``.
"""

from __future__ import annotations

import importlib
import sys

DEFAULT_SUITE = "ops"
# suite -> what it measures (each is the module bench.<suite>).
SUITES = {
    "ops": "every backend of every op against the eager baselines: JSON, a table, plots (the default)",
    "peers": "the peers' own functions (TRL, verl) against the same functions patched with ppo_fast",
    "advantages": "pf.group_advantages per registered method against verl's own estimators",
    "policy_losses": "every policy-loss mode, forward + backward: auto, reference and verl",
    "cpu_vs_trl": "the native CPU token_logprobs against TRL's selective_log_softmax and eager; the exp itself",
    "overhead": "what a public op call costs beyond its backend function, on tiny inputs",
    "triton_host": "the Triton ops' host time per call on CPU, kernel launches stubbed, beside native (TRITON_INTERPRET=1)",
    "truncation": "top-k / top-p log-probs against the plain call (native on CPU), the goal ratios",
    "linear_policy_loss": "pf.linear_policy_loss against linear_token_logprobs + policy_loss at the CPU goal shape, fwd+bwd",
    "linear_head_goal": "the fused LM head's CPU goal shape, fwd+bwd: native, eager and TRL, time and peak memory",
    "e2e": "one PPO iteration of ppo_fast.trainer with auto ops against reference ops",
    "trainer_e2e": "the trainer's GRPO/PPO steps on a Llama-shaped ~0.5B model against TRL's GRPOTrainer (GPU)",
    "targets": "the GPU targets, one met/missed line each",
    "vllm_rollout": "rollout speed, --rollout-engine hf against vllm, and the weight sync",
    "packed": "ops on packed tensors (cu_seqlens) against the padded detour and padded tensors, equal valid tokens",
    "padding_free": "--padding-free against the padded layout: the update's tokens/s and peak memory, the built-in step",
    "async": "--max-staleness 1 (a producer process) against the synchronous loop: steps/s and held-out accuracy",
    "lora": "--lora-r against full fine-tuning: the update's peak memory (Llama-shaped), held-out accuracy over seeds",
    "head_tiles": "the Triton fused head's tile configurations on a GPU, forward and backward, against its products",
    "head_plans": "the GEMM-first head's memory plans on a GPU against cuBLAS and Liger's fused GRPO loss",
    "head_model": "the fused LM head's roofline model on paper: FLOPs, bytes, launches, predicted H100/H200 times",
    "static": "the sm_90 code of every kernel, compiled without a GPU, against its budgets",
    "report": "render result JSON files as markdown tables (and, with --plot, one PNG)",
}


def usage() -> str:
    width = max(map(len, SUITES))
    lines = [
        "usage: python -m bench [suite] [options]",
        "",
        f"Runs one benchmark suite; without a suite, {DEFAULT_SUITE!r} (so `python -m bench --quick --device cpu`",
        f"is `python -m bench {DEFAULT_SUITE} --quick --device cpu`).  A suite's options: python -m bench <suite> --help",
        "",
        "suites:",
    ]
    lines += [f"  {name:{width}s}  {what}" for name, what in SUITES.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv and not argv[0].startswith("-") and argv[0] not in SUITES:
        print(usage(), file=sys.stderr)
        print(f"\npython -m bench: unknown suite {argv[0]!r}", file=sys.stderr)
        return 2
    suite = argv.pop(0) if argv and argv[0] in SUITES else DEFAULT_SUITE
    return importlib.import_module(f"{__package__ or 'bench'}.{suite}").main(argv)


if __name__ == "__main__":
    sys.exit(main())
