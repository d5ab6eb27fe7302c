"""The Triton ops' two entries (``ppo_fast.backends.triton._eager``): a plain eager call runs the op's
functions under a plain ``autograd.Function``, anything else (a dispatch mode, fake or meta tensors,
torch.compile) the custom op.  Both give the same bits, forward and backward, and the same
second-order behaviour.  Under the interpreter (conftest sets TRITON_INTERPRET=1): small shapes."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from tiers import case as tier_case  # noqa: E402

from ppo_fast.backends.triton import gae as tgae  # noqa: E402
from ppo_fast.backends.triton import group_advantages as tgroup  # noqa: E402
from ppo_fast.backends.triton import kl_penalized_rewards as tkl  # noqa: E402
from ppo_fast.backends.triton import linear_token_logprobs as tlin  # noqa: E402
from ppo_fast.backends.triton import token_logprobs as tlp  # noqa: E402
from ppo_fast.backends.triton._launch import DEVICES  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE not in DEVICES, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
IGNORE = -100


def rand(*shape, dtype=torch.float32):
    return torch.randn(shape, device=DEVICE).to(dtype)


def _cases():
    """Entry, custom op, positional args (leaves: the float tensors that require grad), keyword args."""
    x, y = rand(6, 4).t(), rand(4, 6, dtype=torch.float64)  # a transposed input, mixed dtypes
    mask, scores = torch.rand(4, 6, device=DEVICE) < 0.6, rand(4)
    logits, labels = rand(2, 5, 9).transpose(0, 1), torch.randint(0, 9, (5, 2), device=DEVICE)
    labels[0, 1] = IGNORE
    hidden, weight, bias = rand(7, 5), rand(11, 5), rand(11)
    flat = torch.randint(0, 11, (7,), device=DEVICE)
    cu_seqlens = torch.tensor([0, 3, 3, 7, 9], dtype=torch.int32, device=DEVICE)  # an empty segment among them
    packed = (rand(18)[::2], rand(9), torch.rand(9, device=DEVICE) > 0.2, cu_seqlens)
    group_index = torch.tensor([0, 2, 0, 2, 1], device=DEVICE)
    truncated = (3, 0.9, 0.1)
    return {
        "kl_estimate": (tkl._kl_estimate, tkl._kl_estimate_op, (x, y, "k3"), {}),
        "kl_penalized_rewards": (
            tkl._kl_penalized_rewards,
            tkl._kl_penalized_rewards_op,
            (scores, x, y, mask, 0.1, "k2"),
            {},
        ),
        "gae": (tgae._gae, tgae._gae_op, (x, y.float(), mask, 0.9, 0.8), {}),
        "gae_varlen": (tgae._gae_varlen, tgae._gae_varlen_op, (*packed, 4), {"gamma": 0.9, "lam": 0.8}),
        "group_sum": (tgroup._group_sum, tgroup._group_sum_op, (rand(5, 3, dtype=torch.float64), group_index), {}),
        "token_logprobs": (tlp._token_logprobs, tlp._token_logprobs_op, (logits, labels, 0.7, True, IGNORE, False), {}),
        "token_logprobs inplace": (
            tlp._token_logprobs,
            tlp._token_logprobs_op,
            (logits.contiguous(), labels, 0.7, False, IGNORE, True),
            {},
        ),
        "token_logprobs truncated inplace": (
            tlp._token_logprobs,
            tlp._token_logprobs_op,
            (logits.contiguous(), labels, 0.7, True, IGNORE, True, *truncated),
            {},
        ),
        "linear_token_logprobs": (
            tlin._linear_token_logprobs,
            tlin._linear_token_logprobs_op,
            (hidden, weight, flat, bias, 0.8, 1.0, 30.0, True, IGNORE, 0, 1.0, 0.0, "gemm"),
            {},
        ),
    }


# The sampler's truncation costs seconds in the interpreter: the full tier.
CASES = [tier_case(name, fast=name != "token_logprobs truncated inplace", id=name) for name in _cases()]


def _run(fn, args, kwargs):
    """``fn``'s outputs, grad_fn and the gradients of a random weighting of its float outputs w.r.t. its
    float tensor arguments (each a fresh leaf, multiplied by one so that an in-place backward writes
    into a buffer of its own)."""
    leaves = [
        a.detach().clone().requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else None for a in args
    ]
    inputs = [a if leaf is None else leaf * 1 for a, leaf in zip(args, leaves)]
    outs = fn(*inputs, **kwargs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    weighted = [o for o in outs if o.is_floating_point() and o.requires_grad]
    loss = sum((o * torch.randn(o.shape, generator=gen, device=DEVICE).to(o.dtype)).sum() for o in weighted)
    live = [leaf for leaf in leaves if leaf is not None]
    grads = torch.autograd.grad(loss, live, allow_unused=True)
    return [o.detach() for o in outs], type(weighted[0].grad_fn).__name__, grads


def _same_bits(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            assert (g.dtype, g.shape) == (w.dtype, w.shape)
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


class Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", CASES)
def test_eager_entry_matches_the_custom_op_bitwise(case):
    """The entry takes the plain Function in eager mode and gives the custom op's outputs and gradients bit for bit."""
    entry, op, args, kwargs = _cases()[case]
    outs, node, grads = _run(entry, args, kwargs)
    with Seen() as seen:  # a mode: the custom ops throughout, the backward op too
        want_outs, want_node, want_grads = _run(op, args, kwargs)
    assert any(name.startswith("ppo_fast_triton.") and "backward" in name for name in seen.ops) or case == "group_sum"
    assert node.startswith("Eager") and want_node.startswith("GeneratedBackwardFor_ppo_fast_triton"), (node, want_node)
    _same_bits(outs, want_outs)
    _same_bits(grads, want_grads)
    with torch.no_grad():  # nothing to record: the op's function, no node
        got = entry(*args, **kwargs)
        with Seen():
            want = op(*args, **kwargs)
    _same_bits(list(got) if isinstance(got, tuple) else [got], list(want) if isinstance(want, tuple) else [want])


def test_modes_fakes_and_meta_take_the_custom_op():
    """A dispatch mode sees the op as one node (the custom op's autograd), a FakeTensorMode and meta tensors
    get its fake kernel: no launcher runs on them."""
    x, y = rand(4, 6).requires_grad_(), rand(4, 6)
    with Seen() as seen:
        out = tkl._kl_estimate(x, y, "k3")
    assert "ppo_fast_triton.kl_estimate.default" in seen.ops
    assert type(out.grad_fn).__name__.startswith("GeneratedBackwardFor"), out.grad_fn
    with Seen() as seen:
        out.sum().backward()
    assert "ppo_fast_triton.kl_estimate_backward.default" in seen.ops
    meta = tkl._kl_estimate(x.to("meta"), y.to("meta"), "k3")
    assert meta.is_meta and meta.shape == x.shape
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = tkl._kl_estimate(mode.from_tensor(x), mode.from_tensor(y), "k3")
    assert type(fake).__name__ == "FakeTensor" and fake.shape == x.shape


def test_second_order_raises_on_both_entries():
    """create_graph=True runs the backward op, whose own autograd raises when differentiated: the same
    error through either entry (never a silent zero)."""
    x, y = rand(4, 6).requires_grad_(), rand(4, 6)
    for fn in (tkl._kl_estimate, tkl._kl_estimate_op):
        (g,) = torch.autograd.grad((fn(x, y, "k3") * rand(4, 6)).sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="kl_estimate_backward"):
            torch.autograd.grad(g.sum(), x)


def test_torch_compile_traces_the_custom_op():
    """Under torch.compile the entry gives Dynamo the custom op (and its fake), not the launchers."""
    seen = []

    def record(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    x, y = rand(4, 6), rand(4, 6)
    torch._dynamo.reset()
    got = torch.compile(lambda a, b: tkl._kl_estimate(a, b, "k3"), backend=record, fullgraph=True)(x, y)
    assert "ppo_fast_triton.kl_estimate.default" in seen, seen
    torch.testing.assert_close(got, tkl._kl_estimate_op(x, y, "k3"), rtol=0, atol=0)


def test_group_sum_stays_twice_differentiable_on_both_entries():
    """group_sum's backward is group_sum itself (linear and symmetric): its second-order gradient is
    the custom op's bit for bit through the eager entry too."""
    values, index = rand(5, 3, dtype=torch.float64).requires_grad_(), torch.tensor([0, 2, 0, 2, 1], device=DEVICE)
    weights = rand(5, 3, dtype=torch.float64)
    second = []
    for fn in (tgroup._group_sum, tgroup._group_sum_op):
        (g,) = torch.autograd.grad((fn(values, index) ** 2 * weights).sum(), values, create_graph=True)
        second += torch.autograd.grad(g.sum(), values)
    assert second[0].abs().sum() > 0
    torch.testing.assert_close(second[0], second[1], rtol=0, atol=0)


@pytest.mark.parametrize("context", ["set_default_device", "torch.device", "meta default"])
@pytest.mark.parametrize("case", ["kl_estimate", "gae_varlen", "token_logprobs inplace"])
def test_default_device_takes_the_eager_entry(case, context):
    """``torch.set_default_device`` (or ``torch.device`` as a context) pushes a ``DeviceContext``, a torch function
    mode that only fills in factory calls' device: the entry still takes the plain Function, and gives the custom
    op's bits in outputs and gradients (the op under the same context, seen by a dispatch mode)."""
    entry, op, args, kwargs = _cases()[case]

    def under_context(fn):
        if context == "torch.device":
            with torch.device(DEVICE):
                return fn()
        torch.set_default_device("meta" if context == "meta default" else DEVICE)
        try:
            return fn()
        finally:
            torch.set_default_device(None)

    outs, node, grads = under_context(lambda: _run(entry, args, kwargs))
    with Seen() as seen:
        want_outs, want_node, want_grads = under_context(lambda: _run(op, args, kwargs))
    assert not torch._C._is_torch_function_mode_enabled()  # the context is gone again
    assert any(name.startswith("ppo_fast_triton.") for name in seen.ops)
    assert node.startswith("Eager") and want_node.startswith("GeneratedBackwardFor_ppo_fast_triton"), (node, want_node)
    _same_bits(outs, want_outs)
    _same_bits(grads, want_grads)


def test_other_function_modes_take_the_custom_op():
    """Any torch function mode besides a ``DeviceContext``, alone or above one, sees the custom op."""
    from torch.overrides import TorchFunctionMode

    class Funcs(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x, y = rand(4, 6).requires_grad_(), rand(4, 6)
    for outer in (None, DEVICE):
        with torch.device(outer) if outer else torch.autograd.set_grad_enabled(True), Funcs() as mode:
            out = tkl._kl_estimate(x, y, "k3")
        assert any("ppo_fast_triton.kl_estimate" in name for name in mode.seen), mode.seen
        assert type(out.grad_fn).__name__.startswith("GeneratedBackwardFor"), out.grad_fn


def test_entry_runs_below_device_contexts_as_the_custom_op():
    """The custom op runs its function below the torch function layer, where a ``DeviceContext`` does not reach
    the function's own factory calls: the entry does the same (an op whose function makes a device-less tensor,
    under a meta default device, gives the same real values through both entries)."""
    from ppo_fast.backends.triton import _eager

    @_eager.custom_op("ppo_fast_test::plus_default_ones")
    def plus_ones(x: torch.Tensor) -> torch.Tensor:
        return x + torch.ones(x.shape)  # no device: the default device's

    plus_ones.register_fake(lambda x: torch.empty_like(x))
    entry = _eager.with_autograd(plus_ones, lambda ctx, grad: grad, lambda ctx, inputs, output: None)
    x = torch.randn(3, requires_grad=True)
    torch.set_default_device("meta")
    try:
        got, want = entry(x), plus_ones(x)
    finally:
        torch.set_default_device(None)
    assert type(got.grad_fn).__name__.startswith("Eager"), got.grad_fn
    _same_bits([got.detach()], [want.detach()])
    _same_bits(torch.autograd.grad(got.sum(), x), torch.autograd.grad(want.sum(), x))
