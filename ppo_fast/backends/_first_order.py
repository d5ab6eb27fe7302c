"""Gradients a backend computed in its forward (the one-pass loss) are constants to autograd: a
second-order gradient through them would be a silent zero.  Under ``create_graph=True`` they are
handed out marked so that differentiating them raises, naming the op and the way out."""

from __future__ import annotations

import torch


def first_order_only(grads: list, op: str, backend: str, inputs: tuple) -> list:
    """``grads`` unchanged, unless autograd is building a graph of this backward (``create_graph``):
    then each one raises when differentiated, also towards ``inputs`` (the op's differentiable
    inputs, so that a gradient taken w.r.t. them reaches the error instead of missing it)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return grads
    present = [g for g in grads if g is not None]
    if not present:
        return grads
    anchors = [x for x in inputs if x is not None and x.requires_grad]
    error = torch._C._functions.DelayedError(
        f"{op}: second-order gradients (create_graph=True) are not supported on the {backend} backend (its "
        "gradients are computed in the forward); use pf.use_backend('reference') for them",
        len(present) + len(anchors),
    )
    marked = error(*[g.detach().requires_grad_() for g in present], *anchors)
    marked = iter(marked if isinstance(marked, tuple) else (marked,))
    return [None if g is None else next(marked) for g in grads]
