"""Backend registry and selection.

Every public op has one implementation per backend:

* ``reference`` -- plain PyTorch (``ppo_fast.backends.reference``), always available, the oracle;
* ``triton``    -- Triton kernels, each op's kernels, launcher and autograd in
  ``ppo_fast.backends.triton.<op>``, CUDA tensors (CPU tensors only under
  ``TRITON_INTERPRET=1``, for testing);
* ``native``    -- the C++/CUDA extension ``ppo_fast._C`` (fake kernels and autograd in
  ``ppo_fast.backends.native.<op>``).

Each backend is a package with one module per op home (the same base name in every backend
and in ``ppo_fast.ops``); a module declares ``SUPPORTED = {op: devices}`` for the ops it
implements, and the package collects them (``collect``) and exposes each op's function.

The backend used by an op is chosen by ``with use_backend(name):``, else by the
environment variable ``PPO_FAST_BACKEND``, else ``auto``.  ``auto`` walks the op's
preference list for the tensors' device and takes the first backend that is
*available* (imported, compiled, kernels registered for that device) and that
serves the op there; it never picks a backend whose import or build failed.
An explicit backend that cannot serve an op raises :class:`BackendUnavailableError`
saying why, instead of falling back silently.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..spec import BACKENDS, OPS

_CHOICES = BACKENDS + ("auto",)

# The package of each backend.  A backend package exposes ``availability() -> (bool, str)``,
# ``SUPPORTED: dict[op, set[device_type]]`` and ``FUNCTIONS: dict[op, fn]`` (each with the
# reference's signature), both collected from its op modules.
_MODULES = {
    "reference": "ppo_fast.backends.reference",
    "triton": "ppo_fast.backends.triton",
    "native": "ppo_fast.backends.native",
}

# ``auto`` preference per device type: fastest correct path first, per op where it
# differs.  A backend that does not serve an op there is skipped; the reference serves all.
_DEFAULT_ORDER = {
    "cuda": ("triton", "native", "reference"),
    # The Triton interpreter is a correctness tool, never a fast path on CPU.
    "cpu": ("native", "reference"),
}
_OP_ORDER = {
    # The CUDA losses are one-pass deterministic reductions (Triton has no loss kernels).
    ("cuda", "clipped_policy_loss"): ("native", "reference"),
    ("cuda", "value_loss"): ("native", "reference"),
}
assert {op for _, op in _OP_ORDER} <= set(OPS)


def op_modules(package: str, path) -> tuple:
    """Every op module of a package (each public submodule, in name order): adding an op's file
    is enough for its package to find it."""
    names = sorted(m.name for m in pkgutil.iter_modules(path) if not m.name.startswith("_"))
    return tuple(importlib.import_module(f"{package}.{name}") for name in names)


def collect(modules) -> tuple[dict[str, set[str]], dict[str, Callable]]:
    """A backend package's ``SUPPORTED`` and functions, from its op modules' ``SUPPORTED``."""
    supported, functions = {}, {}
    for module in modules:
        for op, devices in module.SUPPORTED.items():
            assert op in OPS and op not in supported, f"{module.__name__}: {op} unknown or declared twice"
            supported[op], functions[op] = set(devices), getattr(module, op)
    return supported, functions


def serving(op: str, device_type: str) -> tuple[str, ...]:
    """The available backends that serve ``op`` on ``device_type`` tensors (for tests and benchmarks)."""
    return tuple(name for name in BACKENDS if _serves(name, op, device_type)[0])


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot serve an op on the given device."""


def _validate_name(name: str) -> str:
    if not isinstance(name, str) or name.lower() not in _CHOICES:
        raise ValueError(f"backend must be one of {_CHOICES}, got {name!r}")
    return name.lower()


# The name set by ``use_backend``, per thread.  A thread-local rather than a ContextVar:
# Dynamo traces (and guards on) a thread-local attribute under torch.compile(fullgraph=True)
# in every torch we support, but cannot trace ContextVar.get in torch 2.11.
_requested = threading.local()
# How many use_backend blocks are open, in every thread: while none is, no thread has a name set,
# and resolve skips the thread-local read (0.4 us, a tenth of a small loss's Python).
_open_blocks = 0
_open_blocks_lock = threading.Lock()


def current_backend() -> str:
    """The backend name in force: ``use_backend`` > ``$PPO_FAST_BACKEND`` > ``auto``."""
    name = getattr(_requested, "name", None)
    if name is None:
        name = os.environ.get("PPO_FAST_BACKEND", "auto") or "auto"
        try:
            name = _validate_name(name)
        except ValueError as err:
            raise ValueError(f"PPO_FAST_BACKEND: {err}") from None
    return name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the ops inside the ``with`` block on backend ``name`` (or ``"auto"``)."""
    global _open_blocks
    previous = getattr(_requested, "name", None)
    _requested.name = _validate_name(name)
    with _open_blocks_lock:
        _open_blocks += 1
    try:
        yield
    finally:
        _requested.name = previous
        with _open_blocks_lock:
            _open_blocks -= 1


@dataclass(frozen=True)
class BackendInfo:
    available: bool
    detail: str
    module: object | None


class _Records(dict):
    """The backends' records, with a count of their replacements (``resolve``'s cache checks it
    in one read instead of comparing every record on every call)."""

    replaced = 0

    def __setitem__(self, name, info):
        self.replaced += 1
        super().__setitem__(name, info)

    def __delitem__(self, name):
        self.replaced += 1
        super().__delitem__(name)


_INFO: _Records = _Records()


def backend_info(name: str) -> BackendInfo:
    """Import backend ``name`` once and report whether it works, and why not."""
    if name not in _INFO:
        try:
            module = importlib.import_module(_MODULES[name])
            ok, detail = module.availability()
        except Exception as err:  # an import error is the reason, not a crash
            module, ok, detail = None, False, f"import of {_MODULES[name]} failed: {type(err).__name__}: {err}"
        _INFO[name] = BackendInfo(ok, detail, module if ok else None)
    return _INFO[name]


def load_all() -> None:
    """Import every backend now.  Called when ``ppo_fast`` is imported, so that no import
    happens inside a ``torch.compile`` trace (Dynamo cannot trace ``importlib``)."""
    for name in BACKENDS:
        backend_info(name)


def available_backends() -> dict[str, str]:
    """Each backend with ``"available: ..."`` or the reason it is unavailable."""
    return {
        name: ("available: " if info.available else "unavailable: ") + info.detail
        for name in BACKENDS
        for info in [backend_info(name)]
    }


def require_available(names) -> None:
    """Raise :class:`BackendUnavailableError` naming every one of ``names`` that is unavailable, with
    why (its import error): for CI, where a backend that should work must not quietly drop out."""
    names = [_validate_name(name) for name in names]
    missing = {name: backend_info(name).detail for name in names if not backend_info(name).available}
    if missing:
        raise BackendUnavailableError(
            "required backends are unavailable: " + "; ".join(f"{name}: {why}" for name, why in missing.items())
        )


def _serves(name: str, op: str, device_type: str) -> tuple[bool, str]:
    info = backend_info(name)
    if not info.available:
        return False, f"backend {name!r} is unavailable: {info.detail}"
    devices = info.module.SUPPORTED.get(op, set())
    if device_type not in devices:
        where = ", ".join(sorted(devices)) or "no device"
        return False, f"backend {name!r} serves {op} on {where}, not on {device_type} tensors"
    return True, ""


# resolve's answers by (use_backend's name, $PPO_FAST_BACKEND, op, device type, implemented_by),
# each with the count of record replacements it was made under: a call per op per step would
# otherwise walk the preference list again.  A record replaced since (a test making a backend
# unavailable) makes the answer stale; a refusal is never cached (it raises every time).
_RESOLVED: dict[tuple, tuple[Callable, int]] = {}

# $PPO_FAST_BACKEND as resolve's cache key reads it.  os.environ.get of an unset variable raises
# and catches two KeyErrors: 0.7 us alone, but 5 us a call inside a loss's forward + backward
# (bench overhead's loop, the raw operator with and without it: 46.2 against 41.3 us, CPU).
# CPython's os.environ keeps the encoded items in its own dict, which its setters update; where
# that dict is not there, or under torch.compile (Dynamo traces os.environ.get), os.environ.get.
_ENVIRON = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey("PPO_FAST_BACKEND") if _ENVIRON is not None else None


def _environ_backend(eager: bool = False):
    """``$PPO_FAST_BACKEND``; ``eager``: the caller knows it runs outside torch.compile."""
    if _ENVIRON is None or _ENVIRON is not getattr(os.environ, "_data", None):
        return os.environ.get("PPO_FAST_BACKEND")
    if not eager and torch.compiler.is_compiling():
        return os.environ.get("PPO_FAST_BACKEND")
    value = _ENVIRON.get(_ENV_KEY)
    return None if value is None else os.environ.decodevalue(value)


def resolve(
    op: str, device_type: str, implemented_by: tuple[str, ...] | None = None, label: str | None = None
) -> Callable:
    """The implementation of ``op`` for tensors on ``device_type`` under the current choice.

    ``implemented_by``: for an op used by a registered variant (an advantage method...), the
    backends the variant's registry entry declares; ``auto`` skips the others (so a variant
    that landed in the reference alone falls back to it, for that variant only) and an
    explicit other backend raises, naming ``label`` (the variant)."""
    return _resolve_cached(op, device_type, implemented_by, label, _environ_backend())


def _resolve_cached(op, device_type, implemented_by, label, environ_backend) -> Callable:
    requested = getattr(_requested, "name", None) if _open_blocks else None
    key = (requested, environ_backend, op, device_type, implemented_by)
    hit = _RESOLVED.get(key)
    if hit is not None and hit[1] == _INFO.replaced:
        return hit[0]
    fn = _resolve(op, device_type, implemented_by, label)
    _RESOLVED[key] = (fn, _INFO.replaced)
    return fn


def direct_op(op: str, x, mask=None) -> Callable | None:
    """The operator behind ``resolve(op, x.device.type)`` where it checks every argument itself
    (the backend function's ``direct``: a native op, whose C++ kernel refuses each input the public
    op's checks refuse), in eager mode, with ``mask`` (where the op takes one) bool; else None.
    A public op calls it with the operator's positional arguments and runs its own checks only
    when it raises, to name what it refused: the checks are not paid twice on every call."""
    if type(x) is not torch.Tensor or torch.compiler.is_compiling():
        return None
    if mask is not None and (type(mask) is not torch.Tensor or mask.dtype is not torch.bool):
        return None  # the public op's conversion of a 0/1 mask
    try:
        device_type = "cuda" if x.is_cuda else "cpu" if x.is_cpu else x.device.type  # .device.type: 0.3 us
        fn = _resolve_cached(op, device_type, None, None, _environ_backend(eager=True))
    except BackendUnavailableError:
        return None  # the public checks run first, then the refusal
    return getattr(fn, "direct", None)


def _resolve(op: str, device_type: str, implemented_by: tuple[str, ...] | None, label: str | None) -> Callable:
    name = current_backend()
    if name != "auto":
        if implemented_by is not None and name not in implemented_by:
            raise BackendUnavailableError(
                f"{label or op}: backend {name!r} does not implement it (implemented by: {', '.join(implemented_by)})"
            )
        ok, why = _serves(name, op, device_type)
        if not ok:
            raise BackendUnavailableError(f"{label or op}: {why}")
        return backend_info(name).module.FUNCTIONS[op]
    order = _OP_ORDER.get((device_type, op), _DEFAULT_ORDER.get(device_type, ("native", "reference")))
    for candidate in order:
        if (implemented_by is None or candidate in implemented_by) and _serves(candidate, op, device_type)[0]:
            return backend_info(candidate).module.FUNCTIONS[op]
    return backend_info("reference").module.FUNCTIONS[op]


def resolved_backend_name(op: str, device_type: str) -> str:
    """Which backend ``resolve`` would use (for logging and benchmarks)."""
    fn = resolve(op, device_type)
    return next(
        n for n in BACKENDS if backend_info(n).module is not None and backend_info(n).module.FUNCTIONS.get(op) is fn
    )


def backend_for(op: str, device, *, implemented_by: tuple[str, ...] | None = None, label: str | None = None) -> str:
    """The name of the backend that runs ``op`` on ``device`` (a ``torch.device``, ``"cuda:1"`` or a
    device type) under the current choice (``use_backend`` > ``$PPO_FAST_BACKEND`` > ``auto``):
    the public question the trainer and integrations ask instead of the registry.  An explicit
    backend that cannot serve it raises :class:`BackendUnavailableError` saying why;
    ``implemented_by``/``label``: a registered variant's backends and name (see ``resolve``)."""
    if op not in OPS:
        raise ValueError(f"op must be one of ppo_fast's ops {tuple(OPS)}, got {op!r}")
    device_type = getattr(device, "type", None) or str(device).partition(":")[0]
    fn = resolve(op, device_type, implemented_by, label)
    return next(
        n for n in BACKENDS if backend_info(n).module is not None and backend_info(n).module.FUNCTIONS.get(op) is fn
    )
