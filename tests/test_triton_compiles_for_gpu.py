"""Every Triton kernel variant compiles for a Hopper GPU (sm_90), with or without one here.

The interpreter accepts code that the compiler rejects (e.g. a global that is not
``tl.constexpr``), so the CPU tests alone would not catch it.  Compilation runs in a
subprocess: conftest sets TRITON_INTERPRET=1, under which kernels cannot be compiled.
"""

import os
import subprocess
import sys

import pytest


def _compile_all() -> int:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ppo_fast.kernels import gae, kl_reward, logprobs

    target = GPUTarget("cuda", 90, 32)
    compiled = 0

    def build(kernel, types, constexprs, num_warps=8):
        nonlocal compiled
        signature = {name: ("constexpr" if name in constexprs else types[name]) for name in kernel.arg_names}
        triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=target, options={"num_warps": num_warps})
        compiled += 1

    for in_type, acc in (("bf16", tl.float32), ("fp16", tl.float32), ("fp64", tl.float64)):
        out_type = "fp64" if acc == tl.float64 else "fp32"
        for flag in (False, True):
            build(
                logprobs._token_logprobs_fwd_kernel,
                dict(logits_ptr="*" + in_type, labels_ptr="*i64", logp_ptr="*" + out_type, entropy_ptr="*" + out_type,
                     stats_ptr="*" + out_type, rows_per_outer="i64", outer_stride="i64", inner_stride="i64", vocab="i32",
                     inv_temperature="fp32", ignore_index="i32"),
                dict(RETURN_ENTROPY=flag, ACC=acc, BLOCK_V=4096),
            )
            build(
                logprobs._token_logprobs_bwd_kernel,
                dict(logits_ptr="*" + in_type, grad_ptr="*" + in_type, labels_ptr="*i64", stats_ptr="*" + out_type,
                     entropy_ptr="*" + out_type, grad_logp_ptr="*fp32", grad_entropy_ptr="*fp32", rows_per_outer="i64",
                     outer_stride="i64", inner_stride="i64", grad_outer_stride="i64", grad_inner_stride="i64", vocab="i32",
                     inv_temperature="fp64", ignore_index="i32"),  # fp64: what torch.compile passes
                dict(HAS_GRAD_ENTROPY=flag, ACC=acc, BLOCK_V=4096),
            )
    for estimator in range(len(kl_reward.KL_ESTIMATORS)):
        for in_type, acc in (("bf16", tl.float32), ("fp64", tl.float64)):
            out_type = "fp64" if acc == tl.float64 else "fp32"
            build(kl_reward._kl_estimate_kernel, dict(logp_ptr="*" + in_type, ref_ptr="*fp32", kl_ptr="*" + out_type, numel="i64"),
                  dict(ESTIMATOR=estimator, ACC=acc, BLOCK=1024), num_warps=4)
            build(kl_reward._kl_backward_kernel,
                  dict(logp_ptr="*" + in_type, ref_ptr="*fp32", grad_kl_ptr="*" + out_type, grad_logp_ptr="*" + in_type,
                       grad_ref_ptr="*fp32", numel="i64"),
                  dict(ESTIMATOR=estimator, ACC=acc, BLOCK=1024), num_warps=4)
            build(kl_reward._kl_rewards_kernel,
                  dict(scores_ptr="*" + in_type, logp_ptr="*" + in_type, ref_ptr="*" + in_type, mask_ptr="*i1",
                       rewards_ptr="*" + out_type, kl_ptr="*" + out_type, last_ptr="*i32", length="i32", scores_stride="i64",
                       logp_stride0="i64", logp_stride1="i64", ref_stride0="i64", ref_stride1="i64", mask_stride0="i64",
                       mask_stride1="i64", kl_coef="fp32"),
                  dict(ESTIMATOR=estimator, ACC=acc, BLOCK_T=1024), num_warps=4)
    for in_type, acc in (("bf16", tl.float32), ("fp64", tl.float64)):
        out_type = "fp64" if acc == tl.float64 else "fp32"
        build(gae._gae_kernel,
              dict(rewards_ptr="*" + in_type, values_ptr="*" + in_type, mask_ptr="*i1", advantages_ptr="*" + out_type,
                   returns_ptr="*" + out_type, length="i32", rewards_stride0="i64", rewards_stride1="i64", values_stride0="i64",
                   values_stride1="i64", mask_stride0="i64", mask_stride1="i64", gamma="fp32", lam="fp64"),
              dict(ACC=acc, BLOCK_T=1024))
        for has_adv, has_ret in ((True, True), (True, False), (False, True)):
            build(gae._gae_bwd_kernel,
                  dict(grad_adv_ptr="*" + out_type, grad_ret_ptr="*" + out_type, mask_ptr="*i1", grad_rewards_ptr="*" + in_type,
                       grad_values_ptr="*" + in_type, length="i32", mask_stride0="i64", mask_stride1="i64", gamma="fp32", lam="fp32"),
                  dict(HAS_GRAD_ADV=has_adv, HAS_GRAD_RET=has_ret, ACC=acc, BLOCK_T=1024))
    return compiled


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0 and "ptxas" in result.stderr and "No such file" in result.stderr:
        pytest.skip("this triton install has no ptxas to compile with")
    assert result.returncode == 0, result.stderr[-4000:]  # any kernel that fails to compile raises


if __name__ == "__main__":
    print(f"compiled {_compile_all()} kernel variants for sm_90")
