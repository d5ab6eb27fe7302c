"""Every Triton kernel variant compiles for a Hopper GPU (sm_90), with or without one here,
and its address arithmetic is 64-bit.

The interpreter accepts code that the compiler rejects (e.g. a global that is not
``tl.constexpr``), so the CPU tests alone would not catch it.  Compilation runs in a
subprocess: conftest sets TRITON_INTERPRET=1, under which kernels cannot be compiled.

Integer arguments (strides, lengths) are compiled as ``i32``, the type Triton gives
a Python int that fits in 32 bits, so the TTIR shows whether a kernel widens its
indices before multiplying them by a stride: ``t * stride`` in int32 wraps once
``T * stride`` passes 2**31 (a transposed ``[B, T]`` input with a large B, a big
``N * V`` row offset).  The check: every ``tt.addptr`` offset is i64 and no i32
multiply takes a kernel argument.  Some variants also get the value-1 specialisation
Triton applies to a unit stride at run time.
"""

import os
import re
import subprocess
import sys

import pytest

# The float scalar arguments (hyper-parameters); every other non-pointer argument is an int.
_FLOAT_ARGS = {"inv_temperature", "inv_temperature_lo", "kl_coef", "kl_coef_lo", "gamma", "gamma_lo", "lam", "lam_lo"}
_FLOAT_ARGS |= {"logit_scale", "logit_scale_lo", "logit_softcap", "logit_softcap_lo"}  # linear_logprobs


def _check_int64_addressing(name: str, ttir: str, int_args: list[str]) -> None:
    for line in ttir.splitlines():
        code = line.split(" loc(")[0]
        if "tt.addptr" in code:
            offset_type = code.rsplit(",", 1)[-1].strip()
            assert offset_type == "i64" or offset_type.endswith("xi64>"), f"{name}: 32-bit address offset: {code.strip()}"
        if "arith.muli" in code and re.search(r":\s*(i32|tensor<[0-9x]*xi32>)\s*$", code):
            operands = re.findall(r"%([A-Za-z_][A-Za-z0-9_]*)\b", code.split("=", 1)[1])
            assert not set(operands) & set(int_args), f"{name}: int32 product of an argument: {code.strip()}"


def _compile_all() -> int:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ppo_fast.kernels import gae, kl_reward, linear_logprobs, logprobs

    target = GPUTarget("cuda", 90, 32)
    compiled = 0

    def build(kernel, types, constexprs, num_warps=8, float_type="fp32"):
        """Compile ``kernel``: pointer types from ``types``, other ints i32, floats ``float_type``
        (fp64 is what torch.compile passes), ``constexprs`` as given."""
        nonlocal compiled

        def arg_type(name):
            if name in types:
                return types[name]
            assert not name.endswith("_ptr"), f"{kernel.fn.__name__}: no type for {name}"
            return float_type if name in _FLOAT_ARGS else "i32"

        signature = {name: ("constexpr" if name in constexprs else arg_type(name)) for name in kernel.arg_names}
        result = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=target, options={"num_warps": num_warps})
        int_args = [name for name, kind in signature.items() if kind in ("i32", "i64")]
        _check_int64_addressing(kernel.fn.__name__, result.asm["ttir"], int_args)
        compiled += 1

    for in_type, acc in (("bf16", tl.float32), ("fp16", tl.float32), ("fp64", tl.float64)):
        out_type = "fp64" if acc == tl.float64 else "fp32"
        for flag in (False, True):
            # Any strides, then the usual layout: unit vocab stride, [N, V] rows (Triton specialises ints equal to 1).
            for unit in ({}, {"vocab_stride": 1, "rows_per_outer": 1}):
                build(
                    logprobs._token_logprobs_fwd_kernel,
                    dict(logits_ptr="*" + in_type, labels_ptr="*i64" if flag else "*i32", logp_ptr="*" + out_type,
                         entropy_ptr="*" + out_type, stats_ptr="*" + out_type, ignore_index="i64" if flag else "i32"),
                    dict(RETURN_ENTROPY=flag, ACC=acc, BLOCK_V=4096, **unit),
                    float_type="fp64" if flag else "fp32",
                )
            for has_logp, has_entropy in ((True, False), (True, True), (False, True)):
                build(
                    logprobs._token_logprobs_bwd_kernel,
                    dict(logits_ptr="*" + in_type, grad_ptr="*" + in_type, labels_ptr="*i64", stats_ptr="*" + out_type,
                         entropy_ptr="*" + out_type, grad_logp_ptr="*" + out_type, grad_entropy_ptr="*" + out_type),
                    dict(HAS_GRAD_LOGP=has_logp, HAS_GRAD_ENTROPY=has_entropy, ACC=acc, BLOCK_V=4096,
                         **({"vocab_stride": 1, "grad_vocab_stride": 1} if has_entropy else {})),
                    float_type="fp64" if has_logp else "fp32",
                )
    # Each estimator once; the dtypes' code paths do not depend on it.
    for estimator, in_type, acc in [(e, "bf16", tl.float32) for e in range(len(kl_reward.KL_ESTIMATORS))] + [(2, "fp64", tl.float64)]:
        out_type = "fp64" if acc == tl.float64 else "fp32"
        for strided in (False, True):
            build(kl_reward._kl_estimate_kernel,
                  dict(logp_ptr="*" + in_type, ref_ptr="*fp32", kl_ptr="*" + out_type),
                  dict(ESTIMATOR=estimator, ACC=acc, BLOCK=1024, STRIDED=strided), num_warps=4)
            build(kl_reward._kl_backward_kernel,
                  dict(logp_ptr="*" + in_type, ref_ptr="*fp32", grad_kl_ptr="*" + out_type, grad_logp_ptr="*" + in_type,
                       grad_ref_ptr="*fp32"),
                  dict(ESTIMATOR=estimator, ACC=acc, BLOCK=1024, STRIDED=strided), num_warps=4)
        build(kl_reward._kl_rewards_kernel,
              dict(scores_ptr="*" + in_type, logp_ptr="*" + in_type, ref_ptr="*" + in_type, mask_ptr="*i1",
                   rewards_ptr="*" + out_type, kl_ptr="*" + out_type, last_ptr="*i32"),
              dict(ESTIMATOR=estimator, ACC=acc, BLOCK_T=1024), num_warps=4, float_type="fp64")
        for has_rewards, has_kl in ((True, True), (True, False), (False, True)):
            build(kl_reward._kl_rewards_bwd_kernel,
                  dict(logp_ptr="*" + in_type, ref_ptr="*" + in_type, mask_ptr="*i1" if has_kl else "*i64", last_ptr="*i32",
                       grad_rewards_ptr="*" + out_type, grad_kl_ptr="*" + out_type, grad_scores_ptr="*" + in_type,
                       grad_logp_ptr="*" + in_type, grad_ref_ptr="*" + in_type),
                  dict(HAS_GRAD_REWARDS=has_rewards, HAS_GRAD_KL=has_kl, ESTIMATOR=estimator, ACC=acc, BLOCK_T=1024),
                  num_warps=4)
    for in_type, acc in (("bf16", tl.float32), ("fp64", tl.float64)):
        out_type = "fp64" if acc == tl.float64 else "fp32"
        build(gae._gae_kernel,
              dict(rewards_ptr="*" + in_type, values_ptr="*" + in_type, mask_ptr="*i1", advantages_ptr="*" + out_type,
                   returns_ptr="*" + out_type),
              dict(ACC=acc, BLOCK_T=1024))
        for has_adv, has_ret in ((True, True), (True, False), (False, True)):
            build(gae._gae_bwd_kernel,
                  dict(grad_adv_ptr="*" + out_type, grad_ret_ptr="*" + out_type, mask_ptr="*i1", grad_rewards_ptr="*" + in_type,
                       grad_values_ptr="*" + in_type),
                  dict(HAS_GRAD_ADV=has_adv, HAS_GRAD_RET=has_ret, ACC=acc, BLOCK_T=1024), float_type="fp64")
    # The fused LM head at its launch configurations (tl.dot on tensor cores; fp32 as TF32 and IEEE).
    import torch

    for dtype, in_type, precision in ((torch.bfloat16, "bf16", "ieee"), (torch.float16, "fp16", "ieee"),
                                      (torch.float32, "fp32", "tf32"), (torch.float32, "fp32", "ieee"), (torch.float64, "fp64", "ieee")):
        acc, out_type = (tl.float64, "fp64") if dtype == torch.float64 else (tl.float32, "fp32")
        inputs = dict(hidden_ptr="*" + in_type, weight_ptr="*" + in_type, bias_ptr="*" + in_type, labels_ptr="*i64", ignore_index="i64")
        for flag in (False, True):
            block_n, block_v, block_h, num_warps = linear_logprobs._FORWARD_CONFIG[dtype]
            build(linear_logprobs._linear_logprobs_fwd_kernel,
                  dict(inputs, logp_ptr="*" + out_type, entropy_ptr="*" + out_type, lse_ptr="*" + out_type),
                  dict(HAS_BIAS=flag, HAS_SOFTCAP=flag, RETURN_ENTROPY=flag, ACC=acc, DOT_PRECISION=precision,
                       BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_H=block_h, **({"hidden_col_stride": 1, "weight_col_stride": 1} if flag else {})),
                  num_warps=num_warps)
            block_n, block_v, block_h, num_warps = linear_logprobs._BACKWARD_CONFIG[dtype]
            build(linear_logprobs._linear_logprobs_bwd_kernel,
                  dict(inputs, lse_ptr="*" + out_type, entropy_ptr="*" + out_type, grad_logp_ptr="*" + out_type,
                       grad_entropy_ptr="*" + out_type, d_hidden_ptr="*" + out_type, d_weight_ptr="*" + out_type, d_bias_ptr="*" + out_type),
                  dict(HAS_BIAS=flag, HAS_SOFTCAP=flag, HAS_GRAD_LOGP=True, HAS_GRAD_ENTROPY=flag, NEEDS_HIDDEN=True, NEEDS_WEIGHT=True,
                       NEEDS_BIAS=flag, ACC=acc, DOT_PRECISION=precision, BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_H=block_h),
                  num_warps=num_warps, float_type="fp64" if flag else "fp32")
    return compiled


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0 and "ptxas" in result.stderr and "No such file" in result.stderr:
        pytest.skip("this triton install has no ptxas to compile with")
    assert result.returncode == 0, result.stderr[-4000:]  # any kernel that fails to compile or check raises


def test_int64_check_catches_an_int32_stride_product():
    """The TTIR check itself: an int32 ``t * stride`` (the bug it guards against) is reported."""
    ttir = (
        "  %t = tt.make_range {end = 1024 : i32, start = 0 : i32} : tensor<1024xi32>\n"
        "  %p = arith.muli %t, %mask_stride1 : tensor<1024xi32> loc(#loc1)\n"
        "  %q = tt.addptr %mask_ptr, %p : tensor<1024x!tt.ptr<i1>>, tensor<1024xi32> loc(#loc2)\n"
    )
    with pytest.raises(AssertionError, match="int32 product"):
        _check_int64_addressing("k", ttir.replace("tt.addptr", "tt.nothing"), ["mask_stride1"])
    with pytest.raises(AssertionError, match="32-bit address offset"):
        _check_int64_addressing("k", ttir, [])


if __name__ == "__main__":
    print(f"compiled {_compile_all()} kernel variants for sm_90")
