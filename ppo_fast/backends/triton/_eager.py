"""The Triton ops' eager entry: a custom op's own Python function under a plain ``torch.autograd.Function``.

A ``torch.library.custom_op`` with ``register_autograd`` costs tens of microseconds of Python a
forward + backward on the host besides its launchers (``bench triton_host``: the layers of
``kl_estimate``), which every eager GPU user pays per call.  ``custom_op`` here records the op's function;
``with_autograd`` registers the op's autograd and returns its entry, which runs the same function,
setup_context and backward under a plain ``autograd.Function`` where the call is plain eager
(``plain_eager``), else the custom op.  ``call`` is a backward's call of its backward op: the op's
function where the call is plain eager and records nothing.

Plain eager: not compiling or tracing, no torch dispatch mode (a FakeTensorMode, a counting mode)
and no torch function mode active but ``torch.set_default_device``'s or ``torch.device`` as a
context (a ``DeviceContext``: it only fills in the device of factory calls, and the entry runs the
function with torch function off, as the custom op runs it below that layer), no functorch transform, no
forward-mode AD level, and every tensor argument a plain ``Tensor`` or ``Parameter`` off the meta
device (no FakeTensor, FunctionalTensor or other subclass).  Anything else takes the custom op, so
``torch.compile`` traces the fakes and every mode sees the op as one node.  A backward run to build
a graph (``create_graph=True``, grad mode on) calls its backward op, whose own autograd raises when
differentiated, as the custom op's backward does: one second-order behaviour on both entries.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch.autograd import forward_ad
from torch.utils._device import DeviceContext

# A custom op -> the Python function it was made from (torch keeps it only in a private attribute).
_FUNCTIONS: dict = {}
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
# A custom op -> the positions of the arguments it mutates (for ``call``'s version bump).
_MUTATED: dict = {}


def custom_op(name: str, *, mutates_args=()):
    """``torch.library.custom_op``, the function (and the positions of the arguments it writes) recorded for
    ``with_autograd`` and ``call``."""

    def wrap(fn):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        _FUNCTIONS[op] = fn
        if mutates_args:
            params = list(inspect.signature(fn).parameters)
            _MUTATED[op] = tuple(params.index(n) for n in mutates_args)
        return op

    return wrap


def _device_contexts_only() -> bool:
    """Whether every torch function mode on the stack is a ``DeviceContext`` (``set_default_device``)."""
    stack = torch._C._get_function_stack_at
    return all(type(stack(i)) is DeviceContext for i in range(torch._C._len_torch_function_stack()))


def _below_function_modes(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with torch function off where a mode is on (only ``DeviceContext``s pass
    ``plain_eager``): the custom op runs its function below that layer, where a ``DeviceContext`` does not
    reach the function's own factory calls; the eager entry does the same."""
    if not torch._C._is_torch_function_mode_enabled():
        return fn(*args, **kwargs)
    with torch._C.DisableTorchFunction():
        return fn(*args, **kwargs)


def plain_eager(args) -> bool:
    """Whether a call with ``args`` may skip the custom op (the module's docstring: plain eager)."""
    if (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack()
        or (torch._C._is_torch_function_mode_enabled() and not _device_contexts_only())
        or torch._C._are_functorch_transforms_active()
        or forward_ad._current_level >= 0
    ):
        return False
    for a in args:
        if isinstance(a, torch.Tensor) and (type(a) not in _PLAIN_TYPES or a.is_meta):
            return False
    return True


def call(op, *args, **kwargs):
    """A backward op's call from a backward: its function in a plain eager call that records nothing
    (grad mode off: no ``create_graph``), else the op.  A mutated argument's version is bumped as the
    op's would be, so a saved tensor it overwrote is still caught by autograd."""
    if torch.is_grad_enabled() or not plain_eager((*args, *kwargs.values()) if kwargs else args):
        return op(*args, **kwargs)
    out = _below_function_modes(_FUNCTIONS[op], *args, **kwargs)
    mutated = _MUTATED.get(op)
    if mutated:
        torch.autograd.graph.increment_version([args[i] for i in mutated if args[i] is not None])
    return out


def with_autograd(op, backward: Callable, setup_context: Callable) -> Callable:
    """Register ``backward`` and ``setup_context`` as ``op``'s autograd and return its entry:
    ``entry(*args, **kwargs)`` gives what ``op`` gives, through a plain ``autograd.Function``
    in a plain eager call, else through ``op``."""
    op.register_autograd(backward, setup_context=setup_context)
    fn = _FUNCTIONS[op]
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind is not p.KEYWORD_ONLY]
    # setup_context sees every positional argument, defaults filled in, as the custom op's does.
    defaults = tuple(p.default for p in positional if p.default is not p.empty)
    count, keyword_only = len(positional), len(positional) < len(params)

    # The old style (forward takes ctx): apply binds no signature per call.
    def forward(ctx, *args):
        if keyword_only:
            *args, kwargs = args
            out = fn(*args, **kwargs)
            setup_context(ctx, tuple(args), kwargs, out)
        else:
            out = fn(*args)
            setup_context(ctx, args, out)
        return out

    def eager_backward(ctx, *grads):
        if not keyword_only:
            return backward(ctx, *grads)
        needs = ctx.needs_input_grad
        ctx.needs_input_grad = needs[:-1]  # the keyword arguments' slot is not an input of the op
        try:
            return (*backward(ctx, *grads), None)
        finally:
            ctx.needs_input_grad = needs

    methods = {"forward": staticmethod(forward), "backward": staticmethod(eager_backward)}
    Eager = type(f"Eager{fn.__name__}", (torch.autograd.Function,), methods)

    def entry(*args, **kwargs):
        if not plain_eager((*args, *kwargs.values()) if kwargs else args):
            return op(*args, **kwargs)
        if not (torch.is_grad_enabled() and torch._C._any_requires_grad(*args, *kwargs.values())):
            return _below_function_modes(fn, *args, **kwargs)  # nothing to record: the op's own function
        if len(args) < count:
            args = args + defaults[len(args) - count :]
        return _below_function_modes(Eager.apply, *args, *((kwargs,) if keyword_only else ()))

    return entry
