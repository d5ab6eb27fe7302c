"""On CUDA no public op synchronises the host: every op, forward and backward, on every
backend that serves CUDA, under ``torch.cuda.set_sync_debug_mode("error")`` (which raises
on any synchronising CUDA call).  The GPU tests are skipped here and run by bench/gpu_check.sh;
``test_cuda_path_reads_nothing_to_the_host`` runs the same calls on CPU tensors with the checks
taking their CUDA branch, and fails on any operator that reads a tensor's values to the host."""

import contextlib
from functools import partial
from unittest import mock

import pytest
import torch
from tiers import case
from torch.utils._python_dispatch import TorchDispatchMode

import ppo_fast as pf
from ppo_fast import _validation
from ppo_fast.backends import _serves, serving
from ppo_fast.spec import AGG_MODES, BACKENDS, OPS, POLICY_LOSS_MODES


def needs_cuda(test):
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


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


def _labels(y, vocab, dtype=torch.int64):
    """``y`` with ignored rows (-100) and out-of-range labels (-5, V): on CUDA a NaN row, no error."""
    y = y.clone()
    y.view(-1)[::7], y.view(-1)[3::11], y.view(-1)[5::13] = -100, vocab, -5
    return y.to(dtype)


TRUNCATION = dict(top_k=50, top_p=0.9, min_p=0.01)
# Options and public functions beyond each op's call above, where a check could read a value:
# label values, truncation, a strided slice, every agg, every advantage method. name -> (op, call).
VARIANTS = {
    "token_logprobs[labels,truncation]": (
        "token_logprobs",
        lambda r, m, fm, y, s: pf.token_logprobs(
            r(*s).requires_grad_(), _labels(y, s[2], torch.int32), return_entropy=True, **TRUNCATION
        ),
    ),
    "token_logprobs[slice]": (
        "token_logprobs",
        lambda r, m, fm, y, s: (pf.token_logprobs(r(s[0], s[1] + 1, s[2]).requires_grad_()[:, :-1], _labels(y, s[2])),),
    ),
    "linear_token_logprobs[labels,truncation]": (
        "linear_token_logprobs",
        lambda r, m, fm, y, s: pf.linear_token_logprobs(
            r(*s[:2], 64).requires_grad_(),
            r(s[2], 64).requires_grad_(),
            _labels(y, s[2]),
            return_entropy=True,
            **TRUNCATION,
        ),
    ),
    **{
        f"linear_policy_loss_vanilla[labels,{agg}]": (
            "linear_policy_loss_vanilla",
            lambda r, m, fm, y, s, agg=agg: pf.linear_policy_loss(
                r(*s[:2], 64).requires_grad_(),
                r(s[2], 64).requires_grad_(),
                _labels(y, s[2]),
                -r(*s[:2]).abs(),
                r(*s[:2]),
                fm,
                agg=agg,
                weights=r(*s[:2]).abs(),
                **TRUNCATION,
            )[:1],
        )
        for agg in AGG_MODES
    },
    **{
        f"aggregate[{agg}]": (
            None,
            lambda r, m, fm, y, s, agg=agg: (pf.aggregate(r(*s[:2]).requires_grad_(), fm, agg),),
        )
        for agg in AGG_MODES
    },
    "masked_mean": (None, lambda r, m, fm, y, s: (pf.masked_mean(r(*s[:2]).requires_grad_(), fm, dim=1),)),
    "masked_whiten": (None, lambda r, m, fm, y, s: (pf.masked_whiten(r(*s[:2]).requires_grad_(), m),)),
    **{
        f"rollout_correction_weights[{mode}]": (
            None,
            lambda r, m, fm, y, s, mode=mode: (
                pf.rollout_correction_weights(
                    -r(*s[:2]).abs(),
                    -r(*s[:2]).abs(),
                    fm,
                    mode=mode,
                    threshold_low=0.5 if "mis" in mode else 0.0,
                    batch_normalize=True,
                ),
            ),
        )
        for mode in ("token_tis", "seq_tis", "token_mis", "seq_mis")
    },
    **{
        f"group_advantages[{name}]": (
            None,  # auto: each method names the backends that implement it
            lambda r, m, fm, y, s, name=name: (
                pf.group_advantages(
                    r(s[0]).requires_grad_(),
                    torch.arange(s[0], device=m.device) // 2,
                    m,
                    method=name,
                    **({"baselines": r(s[0])} if name == "remax" else {}),
                ),
            ),
        )
        for name in pf.advantage_methods()
        if name != "gae"
    },
}


ALL_CALLS = {op: (op, call) for op, call in CALLS.items()} | VARIANTS


def _backends(op, device_type):
    """The backends that serve ``op`` there (a public function over several ops: ``auto``)."""
    return list(serving(op, device_type)) if op else ["auto"]


@pytest.mark.parametrize(
    "name, backend",
    [(n, b) for n, (op, _) in ALL_CALLS.items() for b in _backends(op, "cuda")] if torch.cuda.is_available() else [],
)
@needs_cuda
def test_op_forward_and_backward_never_sync_the_host(name, backend):
    call = ALL_CALLS[name][1]
    rand, mask, float_mask, labels, shape = _inputs("cuda")
    with pf.use_backend(backend):
        call(rand, mask, float_mask, labels, shape)  # warm-up: Triton compiles, caches fill
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outputs = call(rand, mask, float_mask, labels, shape)
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
    """The fused head on the packed tokens: the one pass on the packed row (vanilla); GSPO's one pass with
    ``cu_seqlens`` on the host, its two passes with it on CUDA."""
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
DOCUMENTED_SYNC = ("gae", "reference", False)


def _packed_inputs(device, given):
    rand, mask, _, labels, _ = _inputs(device)
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], device=device)
    kw = dict(cu_seqlens=cu_seqlens, max_seqlen=max(LENGTHS) if given else None, labels=labels.reshape(-1))
    return rand, mask.reshape(-1), kw


@pytest.mark.parametrize("host", [False, True], ids=["cuda-cu_seqlens", "host-cu_seqlens"])
@pytest.mark.parametrize("given", [False, True], ids=["device-max_seqlen", "max_seqlen"])
@pytest.mark.parametrize(
    "op, backend", [(op, b) for op in PACKED_OPS for b in _cuda_backends(op)] if torch.cuda.is_available() else []
)
@needs_cuda
def test_packed_ops_never_sync_the_host(op, backend, given, host):
    """With ``cu_seqlens`` on CUDA, or on the host (checked there, copied without a sync; GSPO's fused
    head then takes its one pass, and the longest length is known on the host)."""
    if (op, backend, given) == DOCUMENTED_SYNC and not host:
        pytest.skip("the reference scan reads its bound on the host without max_seqlen (docs/ops.md)")
    rand, mask, kw = _packed_inputs("cuda", given)
    if host:
        kw["cu_seqlens"] = kw["cu_seqlens"].cpu()
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


@needs_cuda
def test_a_host_cu_seqlens_is_refused_in_a_cuda_graph_capture():
    """A host ``cu_seqlens`` reaches the device from a pinned block that the caching allocator reuses once
    the copy has run: a graph's replay would copy whatever that block then holds, so a capture refuses it,
    naming it."""
    rand, mask, kw = _packed_inputs("cuda", True)
    values, rewards = rand(mask.numel()), rand(mask.numel())
    kw["cu_seqlens"] = kw["cu_seqlens"].cpu()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graph asks
        pf.gae(rewards, values, mask, gamma=0.99, lam=0.95, **kw)
    torch.cuda.current_stream().wait_stream(side)
    with pytest.raises(ValueError, match="cu_seqlens on the host cannot be captured in a CUDA graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            pf.gae(rewards, values, mask, gamma=0.99, lam=0.95, **kw)


@needs_cuda
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


# ----------------------------------------------------------------------------- on CPU, as on CUDA

_ATEN = torch.ops.aten
# The operators whose result is a tensor's value on the host (item, bool, int, float, equal) or a
# size known only from values (nonzero, masked_select, unique; a bool index is a nonzero): on a
# CUDA tensor each waits for the device.
_HOST_READS = {
    _ATEN._local_scalar_dense.default,
    _ATEN.nonzero.default,
    _ATEN.equal.default,
    _ATEN.masked_select.default,
    _ATEN._unique2.default,
    _ATEN.unique_consecutive.default,
}


class HostReads(TorchDispatchMode):
    """Raises on the first operator that reads tensor values to the host (``_HOST_READS``, a bool
    index; ``tolist``/``numpy`` read without an operator and are patched by ``cuda_branch``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        bool_index = func in (_ATEN.index.Tensor, _ATEN.index_put.default, _ATEN.index_put_.default) and any(
            i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]
        )
        sized_by_values = func is _ATEN.repeat_interleave.Tensor and (kwargs or {}).get("output_size") is None
        if func in _HOST_READS or bool_index or sized_by_values:
            raise AssertionError(f"{func} reads tensor values to the host: a sync on CUDA")
        return func(*args, **(kwargs or {}))


def _refuse(self, *args, **kwargs):
    raise AssertionError("Tensor.tolist/numpy reads tensor values to the host: a sync on CUDA")


def _run_reading_nothing(backend, call, *, cuda_branch=True):
    """``call()`` and its backward, raising on any host read of a tensor; with ``cuda_branch`` the
    checks take the branch they take for CUDA tensors (``host_checks_free`` is False there)."""
    branch = mock.patch.object(_validation, "host_checks_free", lambda *tensors: False)
    with (
        pf.use_backend(backend),
        branch if cuda_branch else contextlib.nullcontext(),
        mock.patch.object(torch.Tensor, "tolist", _refuse),
        mock.patch.object(torch.Tensor, "numpy", _refuse),
        HostReads(),
    ):
        differentiable = [o.float().sum() for o in call() if o.requires_grad]
        if differentiable:
            sum(differentiable).backward()


# The backends that serve each op on CUDA when their kernels are there (available or not here).
_SERVE_CUDA = {op: {b for b in BACKENDS if _serves(b, op, "cuda")[0]} for op in OPS}


def _cpu_cases():
    """Every call on the backends that serve it on CUDA and run here; the Triton interpreter's (a few
    seconds each) in the full tier."""
    for name, (op, _) in ALL_CALLS.items():
        for backend in _backends(op, "cpu"):
            if not op or backend in _SERVE_CUDA[op]:
                yield case(name, backend, fast=backend != "triton", id=f"{name}-{backend}")


@pytest.mark.parametrize("name, backend", list(_cpu_cases()))
def test_cuda_path_reads_nothing_to_the_host(name, backend):
    """Every public call, forward and backward, with the checks on their CUDA branch, on every
    backend that serves CUDA and runs here (the native CPU kernels stand in for the CUDA ones: only
    the Python around them is checked).  A Triton op is seen as its custom op, one node: what its
    launcher does inside is not seen here, only on a GPU, by the sync-debug test above."""
    rand, mask, float_mask, labels, shape = _inputs("cpu")
    _run_reading_nothing(backend, lambda: ALL_CALLS[name][1](rand, mask, float_mask, labels, shape))


@pytest.mark.parametrize("given", [False, True], ids=["device-max_seqlen", "max_seqlen"])
@pytest.mark.parametrize(
    "op, backend",
    [
        case(op, b, fast=b != "triton", id=f"{op}-{b}")
        for op in PACKED_OPS
        for b in _backends(op, "cpu")
        if b in _SERVE_CUDA[op]
    ],
)
def test_packed_cuda_path_reads_nothing_to_the_host(op, backend, given):
    rand, mask, kw = _packed_inputs("cpu", given)
    if (op, backend, given) == DOCUMENTED_SYNC:
        with pytest.raises(AssertionError, match="host"):  # the documented one is seen
            _run_reading_nothing(backend, lambda: _packed(rand, mask, **kw)[op]())
        return
    _run_reading_nothing(backend, lambda: _packed(rand, mask, **kw)[op]())


@pytest.mark.parametrize(
    "call",
    [
        lambda r, m, fm, y, s: (pf.token_logprobs(r(*s), _labels(y, s[2]) % s[2]),),  # labels read on CPU
        lambda r, m, fm, y, s: (pf.masked_whiten(r(*s[:2]), m),),  # an all-masked input refused on CPU
        lambda r, m, fm, y, s: (  # a group of one refused on CPU
            pf.group_advantages(r(s[0]), torch.arange(s[0]), m, method="grpo_passk"),
        ),
        lambda r, m, fm, y, s: pf.gae(  # cu_seqlens' ends checked on CPU
            r(s[0] * s[1]), r(s[0] * s[1]), m.view(-1), gamma=1.0, lam=1.0, cu_seqlens=torch.tensor([0, s[0] * s[1]])
        ),
    ],
    ids=["labels", "whiten", "group-size", "cu_seqlens"],
)
def test_the_host_read_detector_sees_the_cpu_checks(call):
    """The detector is not blind: the checks' CPU branch reads values, and it raises there."""
    rand, mask, float_mask, labels, shape = _inputs("cpu")
    with pytest.raises(AssertionError, match="host"):
        _run_reading_nothing("reference", lambda: call(rand, mask, float_mask, labels, shape), cuda_branch=False)
