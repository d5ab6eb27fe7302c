"""On CUDA no public op synchronises the host: every op, forward and backward, on every
backend that serves CUDA, under ``torch.cuda.set_sync_debug_mode("error")`` (which raises
on any synchronising CUDA call).  Needs a GPU: skipped here, run by bench/gpu_check.sh."""

from functools import partial

import pytest
import torch

import ppo_fast as pf
from ppo_fast.backends import serving
from ppo_fast.spec import OPS, POLICY_LOSS_MODES

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _cuda_backends(op):
    return list(serving(op, "cuda"))


def _inputs(device):
    # Drawn on the device: a copy from the host would be the synchronisation the test looks for.
    gen = torch.Generator(device=device).manual_seed(0)
    b, t, v = 4, 33, 1000

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    mask = torch.rand(b, t, generator=gen, device=device) < 0.8
    float_mask = mask.float()
    labels = torch.randint(0, v, (b, t), generator=gen, device=device)
    return rand, mask, float_mask, labels, (b, t, v)


CALLS = {
    "token_logprobs": lambda r, m, fm, y, s: pf.token_logprobs(
        r(*s).requires_grad_(), y, return_entropy=True, temperature=0.8
    ),
    "linear_token_logprobs": lambda r, m, fm, y, s: pf.linear_token_logprobs(
        r(*s[:2], 64).requires_grad_(),
        r(s[2], 64).requires_grad_(),
        y,
        bias=r(s[2]).requires_grad_(),
        return_entropy=True,
        logit_softcap=30.0,
    ),
    "kl_estimate": lambda r, m, fm, y, s: (pf.kl_estimate(r(*s[:2]).requires_grad_(), r(*s[:2]), "k3"),),
    "kl_penalized_rewards": lambda r, m, fm, y, s: pf.kl_penalized_rewards(
        r(s[0]).requires_grad_(), r(*s[:2]).requires_grad_(), r(*s[:2]), fm, kl_coef=0.1, kl_estimator="k3"
    ),
    "gae": lambda r, m, fm, y, s: pf.gae(
        r(*s[:2]).requires_grad_(), r(*s[:2]).requires_grad_(), m, gamma=0.99, lam=0.95
    ),
    "clipped_policy_loss": lambda r, m, fm, y, s: pf.clipped_policy_loss(
        r(*s[:2]).requires_grad_(), r(*s[:2]), r(*s[:2]).requires_grad_(), fm, dual_clip=3.0, agg="seq-mean-token-mean"
    )[:1],
    "value_loss": lambda r, m, fm, y, s: pf.value_loss(r(*s[:2]).requires_grad_(), r(*s[:2]), r(*s[:2]), m)[:1],
    "group_sum": lambda r, m, fm, y, s: (
        pf.group_advantages(r(s[0]).requires_grad_(), torch.arange(s[0], device=m.device) // 3 * 7, m, method="grpo"),
    ),
}
for _mode in POLICY_LOSS_MODES.values():
    if not _mode.syncs_host:  # clip_cov and kl_cov select tokens on the host, as verl's
        CALLS.setdefault(
            _mode.op,
            lambda r, m, fm, y, s, name=_mode.name: pf.policy_loss(
                -r(*s[:2]).abs().requires_grad_(),
                -r(*s[:2]).abs(),
                r(*s[:2]).requires_grad_(),
                fm,
                loss_mode=name,
                **POLICY_LOSS_MODES[name].example_params(),
            )[:1],
        )
    if _mode.fused_head:
        CALLS[_mode.linear_op] = lambda r, m, fm, y, s, name=_mode.name: pf.linear_policy_loss(
            r(*s[:2], 64).requires_grad_(),
            r(s[2], 64).requires_grad_(),
            y,
            -r(*s[:2]).abs(),
            r(*s[:2]),
            m,
            loss_mode=name,
            ref_logprobs=-r(*s[:2]).abs(),
            kl_coef=0.1,
            entropy_coef=0.01,
            **POLICY_LOSS_MODES[name].example_params(),
        )[:1]
SYNCING_OPS = {mode.op for mode in POLICY_LOSS_MODES.values() if mode.syncs_host}
assert set(CALLS) == set(OPS) - SYNCING_OPS


@pytest.mark.parametrize(
    "op, backend", [(op, b) for op in CALLS for b in _cuda_backends(op)] if torch.cuda.is_available() else []
)
def test_op_forward_and_backward_never_sync_the_host(op, backend):
    rand, mask, float_mask, labels, shape = _inputs("cuda")
    with pf.use_backend(backend):
        CALLS[op](rand, mask, float_mask, labels, shape)  # warm-up: Triton compiles, caches fill
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outputs = CALLS[op](rand, mask, float_mask, labels, shape)
            total = sum(o.float().sum() for o in outputs if o.requires_grad)
            total.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


# The packed layout (cu_seqlens, an empty sequence and a single token among them): the segmented
# kernels read the segments' bounds on the device, with or without max_seqlen.
LENGTHS = [5, 0, 1, 40, 86]  # 132 tokens: the [4, 33] inputs flattened


def _seq_loss(rand, mask, mode, **kw):
    n = mask.numel()
    lp, old = (-rand(n).abs() for _ in range(2))
    params = mode.example_params()
    return pf.policy_loss(
        lp.requires_grad_(), old, rand(n), mask, loss_mode=mode.name, weights=rand(n).abs(), **params, **kw
    )[:1]


def _fused_head(rand, mask, labels, mode, **kw):
    """The fused head on the packed tokens: the one pass on the packed row (vanilla), GSPO's two passes."""
    n, vocab = mask.numel(), 1000
    return pf.linear_policy_loss(
        rand(n, 64).requires_grad_(),
        rand(vocab, 64).requires_grad_(),
        labels,
        -rand(n).abs(),
        rand(n),
        mask,
        loss_mode=mode.name,
        agg="seq-mean-token-mean",
        ref_logprobs=-rand(n).abs(),
        kl_coef=0.1,
        entropy_coef=0.01,
        **mode.example_params(),
        **kw,
    )[:1]


def _packed(rand, mask, labels=None, **kw):
    n = mask.numel()
    lp = lambda: -rand(n).abs()  # noqa: E731
    seq_mean = dict(kw, agg="seq-mean-token-sum-norm")
    return {
        "gae": lambda: pf.gae(rand(n).requires_grad_(), rand(n).requires_grad_(), mask, gamma=0.99, lam=0.95, **kw),
        "kl_penalized_rewards": lambda: pf.kl_penalized_rewards(
            rand(len(LENGTHS)), lp().requires_grad_(), lp(), mask, kl_coef=0.1, **kw
        ),
        "value_loss": lambda: pf.value_loss(rand(n).requires_grad_(), rand(n), rand(n), mask, **seq_mean)[:1],
        "clipped_policy_loss": lambda: pf.clipped_policy_loss(
            lp().requires_grad_(), lp(), rand(n).requires_grad_(), mask, **seq_mean
        )[:1],
        **{
            mode.op: partial(_seq_loss, rand, mask, mode, agg="seq-mean-token-mean", **kw)
            for mode in POLICY_LOSS_MODES.values()
            if mode.sequence_level
        },
        **{
            POLICY_LOSS_MODES[name].linear_op: partial(_fused_head, rand, mask, labels, POLICY_LOSS_MODES[name], **kw)
            for name in ("vanilla", "gspo")
        },
    }


PACKED_OPS = ["gae", "kl_penalized_rewards", "value_loss", "clipped_policy_loss"] + [
    mode.op for mode in POLICY_LOSS_MODES.values() if mode.sequence_level
]
PACKED_OPS += [POLICY_LOSS_MODES[name].linear_op for name in ("vanilla", "gspo")]


@pytest.mark.parametrize("given", [False, True], ids=["device-max_seqlen", "max_seqlen"])
@pytest.mark.parametrize(
    "op, backend", [(op, b) for op in PACKED_OPS for b in _cuda_backends(op)] if torch.cuda.is_available() else []
)
def test_packed_ops_never_sync_the_host(op, backend, given):
    if (op, backend, given) == ("gae", "reference", False):
        pytest.skip("the reference scan reads its bound on the host without max_seqlen (docs/ops.md)")
    rand, mask, _, labels, _ = _inputs("cuda")
    mask = mask.reshape(-1)
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], device="cuda")
    kw = dict(cu_seqlens=cu_seqlens, max_seqlen=max(LENGTHS) if given else None, labels=labels.reshape(-1))
    with pf.use_backend(backend):
        _packed(rand, mask, **kw)[op]()  # warm-up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outputs = _packed(rand, mask, **kw)[op]()
            sum(o.float().sum() for o in outputs if o.requires_grad).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize(
    "op, backend", [(op, b) for op in CALLS for b in _cuda_backends(op)] if torch.cuda.device_count() > 1 else []
)
def test_ops_on_a_device_other_than_the_current_one(op, backend):
    rand, mask, float_mask, labels, shape = _inputs("cuda:1")
    torch.cuda.set_device(0)
    with pf.use_backend(backend):
        got = CALLS[op](rand, mask, float_mask, labels, shape)
    rand, mask, float_mask, labels, shape = _inputs("cuda:1")
    with pf.use_backend("reference"):
        want = CALLS[op](rand, mask, float_mask, labels, shape)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
