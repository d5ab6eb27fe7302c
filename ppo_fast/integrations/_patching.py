"""The patch handle shared by the peer adapters: install, restore, version check, counters.

A peer adapter (``ppo_fast.integrations.verl``, ``.trl``, ``.openrlhf``) lists what it
replaces as :class:`Target` s (a module or class attribute, or a registry entry) and
calls :func:`install`.  Installing replaces each target in place, and also every alias
of the original object that the peer's already-imported modules hold (``from x import
f`` binds a second name); restoring puts the originals back wherever our replacement
still sits.  Patching twice is harmless: the replacements are installed once, each
``patch()`` call returns its own :class:`PatchHandle`, and the patch stays until every
handle is closed or the module-level ``unpatch()`` restores the originals.

Every replacement counts its calls in :data:`COUNTS` (``"verl.compute_gae_advantage_return"``
-> n), and the calls it hands back to the peer's original (hyper-parameters outside
the domain of our ops) under ``"<name>:fallback"``: tests and users can see that our ops ran.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import ppo_fast as pf
from ppo_fast.spec import BACKENDS

COUNTS: Counter = Counter()

_LOCK = threading.RLock()


class UnsupportedPeerVersion(RuntimeError):
    """The installed peer's version is not one the adapter was written and tested for."""


def peer_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_version(peer: str, distribution: str, supported: tuple[str, ...]) -> str:
    """The installed version of ``distribution``; raises :class:`UnsupportedPeerVersion`
    unless it starts with one of the ``supported`` prefixes (``"0.9"`` accepts 0.9.x)."""
    version = peer_version(distribution)
    if version is None:
        raise ImportError(f"ppo_fast.integrations.{peer}: {distribution} is not installed")
    if not any(version == s or version.startswith(s + ".") for s in supported):
        wanted = ", ".join(s + (".x" if s.count(".") < 2 else "") for s in supported)
        raise UnsupportedPeerVersion(
            f"ppo_fast.integrations.{peer} supports {distribution} {wanted}; the installed {distribution} is {version}"
        )
    return version


@dataclass
class Target:
    """One thing to replace: ``owner.name`` (a module or class attribute) or, with
    ``item=True``, ``owner[name]`` (a registry dict entry)."""

    owner: Any
    name: str
    replacement: Any
    item: bool = False
    original: Any = None

    def get(self):
        """The current value (None where the entry or attribute has since been removed)."""
        return self.owner.get(self.name) if self.item else getattr(self.owner, self.name, None)

    def set(self, value) -> None:
        if self.item:
            self.owner[self.name] = value
        else:
            setattr(self.owner, self.name, value)


@dataclass
class _PeerState:
    peer: str
    module_prefix: str
    targets: list[Target]
    # (module, attribute, original, replacement) aliases replaced in the peer's modules
    aliases: list[tuple[Any, str, Any, Any]] = field(default_factory=list)
    # registry entries added (not replaced): removed on restore
    added: list[tuple[dict, str, Any]] = field(default_factory=list)
    handles: list[PatchHandle] = field(default_factory=list)


_STATE: dict[str, _PeerState] = {}


class PatchHandle:
    """What ``patch()`` returns: ``unpatch()`` closes it, ``with`` closes it on exit.

    ``backend`` is the ppo_fast backend the patched functions use while this is the
    newest open handle of its peer.  ``counts()`` gives the calls our replacements served.
    """

    def __init__(self, peer: str, backend: str, version: str):
        self.peer, self.backend, self.version = peer, backend, version
        self.active = True

    def unpatch(self) -> None:
        """Close this handle; the originals come back when no handle of the peer is open."""
        with _LOCK:
            if not self.active:
                return
            self.active = False
            state = _STATE.get(self.peer)
            if state is None:
                return
            if self in state.handles:
                state.handles.remove(self)
            if not state.handles:
                _restore(self.peer)

    def counts(self) -> dict[str, int]:
        prefix = self.peer + "."
        return {k: v for k, v in COUNTS.items() if k.startswith(prefix)}

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.unpatch()

    def __repr__(self) -> str:
        return f"<ppo_fast.integrations.{self.peer} patch: {self.version}, backend={self.backend!r}, {'active' if self.active else 'closed'}>"


def is_patched(peer: str) -> bool:
    return peer in _STATE


def _peer_modules(prefix: str) -> list:
    return [
        m
        for name, m in list(sys.modules.items())
        if m is not None and (name == prefix or name.startswith(prefix + "."))
    ]


def install(
    peer: str,
    module_prefix: str,
    backend: str,
    version: str,
    targets: Callable[[], list[Target]],
    added: Callable[[], list[tuple[dict, str, Any]]] = lambda: [],
) -> PatchHandle:
    """Install ``targets()`` (once per peer) and return a new handle."""
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    with _LOCK:
        state = _STATE.get(peer)
        if state is None:
            state = _PeerState(peer, module_prefix, targets())
            originals = {}
            for t in state.targets:
                t.original = t.get()
                t.set(t.replacement)
                if not t.item:
                    originals[id(t.original)] = (t.original, t.replacement)
            # Names bound by ``from module import f`` in the peer's loaded modules.
            for module in _peer_modules(module_prefix):
                for attr, value in list(vars(module).items()):
                    hit = originals.get(id(value))
                    if (
                        hit is not None
                        and hit[0] is value
                        and not any(module is t.owner and attr == t.name for t in state.targets)
                    ):
                        setattr(module, attr, hit[1])
                        state.aliases.append((module, attr, hit[0], hit[1]))
            for registry, key, value in added():
                if key not in registry:
                    registry[key] = value
                    state.added.append((registry, key, value))
            _STATE[peer] = state
        handle = PatchHandle(peer, backend, version)
        state.handles.append(handle)
        return handle


def _restore(peer: str) -> None:
    state = _STATE.pop(peer, None)
    if state is None:
        return
    replacements = {}
    for t in reversed(state.targets):
        if t.get() is t.replacement:
            t.set(t.original)
        if not t.item:
            replacements[id(t.replacement)] = (t.replacement, t.original)
    for module, attr, original, replacement in state.aliases:
        if getattr(module, attr, None) is replacement:
            setattr(module, attr, original)
    # Modules imported while patched bound our replacements: give them the originals too.
    for module in _peer_modules(state.module_prefix):
        for attr, value in list(vars(module).items()):
            hit = replacements.get(id(value))
            if hit is not None and hit[0] is value:
                setattr(module, attr, hit[1])
    for registry, key, value in state.added:
        if registry.get(key) is value:
            del registry[key]
    for handle in state.handles:
        handle.active = False


def restore_all(peer: str) -> None:
    """The module-level ``unpatch()``: the originals come back whatever handles are open."""
    with _LOCK:
        _restore(peer)


def current_backend(peer: str) -> str:
    state = _STATE.get(peer)
    if state is None or not state.handles:
        return "auto"
    return state.handles[-1].backend


def _serves(name: str, op: str, device_type: str) -> bool:
    """Whether backend ``name`` runs ``op`` on ``device_type`` when asked (the public question, not the registry)."""
    try:
        with pf.use_backend(name):
            return pf.backend_for(op, device_type) == name
    except pf.BackendUnavailableError:
        return False


@contextlib.contextmanager
def backend_for(peer: str, op: str, device_type: str) -> Iterator[None]:
    """Run ``op`` on the backend the peer was patched with, where it serves the op on
    ``device_type`` (Triton serves log-probs, KL and GAE; the losses then run on ``auto``).
    With ``backend="auto"`` ppo_fast's own choice applies (``pf.use_backend``, ``$PPO_FAST_BACKEND``)."""
    name = current_backend(peer)
    if name == "auto" or not _serves(name, op, device_type):
        yield
        return
    with pf.use_backend(name):
        yield


def count(key: str) -> None:
    COUNTS[key] += 1
