"""The packed (varlen) layout of the sequence ops: flash-attn's convention.

Instead of ``[B, T]`` tensors and a mask padded to the longest row, a sequence op takes its
per-token tensors as ``[N, ...]`` (the ``S`` sequences' tokens one after another) and
``cu_seqlens`` ``[S + 1]`` (int32 or int64, on their device or on the host): 0, then each
sequence's end.  The mask keeps its meaning inside a sequence (a tool output inside a response);
sequence-level inputs (``kl_penalized_rewards``' scores) stay ``[S]``.  ``max_seqlen`` (optional,
as flash-attn takes it) is the longest sequence's length: the ``T`` of ``seq-mean-token-sum-norm``
and the bound of a scan.

An op runs on the packed tensors themselves (:class:`Segments`): per-token ops on ``[N]`` as one
row, per-sequence sums and scans over each segment, with the segment of each token and each
segment's bounds computed on the device from ``cu_seqlens``: memory and time linear in ``N``, and
no host sync unless an op's docs say so.  A ``cu_seqlens`` on the host beside tokens on a device is
checked there, at no cost, and copied to the device without a sync; its host copy stays in the
segments (``Segments.host``), where an op can plan by the sequences' ends (``linear_policy_loss``).
The padded detour (:class:`Layout`: the sequences laid out as ``[S, longest]`` rows, the op's padded
implementation, the valid tokens read back) defines the result: a packed result equals it in value
and in every gradient, bit for bit where the padded path does not depend on the batch's layout
(per-token values, per-sequence scans), and up to the order of a sum where it does (a mean over
every token of the batch).  Every packed op keeps it as ``op.padded`` (the oracle the tests compare
with); ops without a packed implementation on a backend run it (``docs/ops.md`` lists them).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from . import _validation as check

CU_SEQLENS_DTYPES = (torch.int32, torch.int64)


def _check_cu_seqlens(cu_seqlens, tokens: int, device: torch.device) -> None:
    """The checks on metadata: a named error for anything else than a 1-D int tensor on ``device``."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in CU_SEQLENS_DTYPES:
        raise TypeError(f"cu_seqlens must have dtype int32 or int64, got {str(cu_seqlens.dtype).replace('torch.', '')}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D [S + 1] with S >= 0, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device and cu_seqlens.device.type != "cpu":
        raise ValueError(f"cu_seqlens must be on the tokens' device {device} or on the host, got {cu_seqlens.device}")


def _check_ends(ends: torch.Tensor, tokens: int) -> None:
    """The checks on values, on the host (CPU ``cu_seqlens``, eager)."""
    if int(ends[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(ends[0])}")
    if bool((ends[1:] < ends[:-1]).any()):
        head = ends[:8].tolist()
        raise ValueError(f"cu_seqlens must be non-decreasing, got {head}{' ...' if len(ends) > 8 else ''}")
    if int(ends[-1]) != tokens:
        raise ValueError(f"cu_seqlens must end at the number of packed tokens {tokens}, got {int(ends[-1])}")


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a host-device sync.  A blocking copy (``.to(device)``) waits
    for the stream, and one from pageable memory may too (the driver may wait to stage it); from a fresh
    pinned copy the copy is queued on the current stream and the call returns at once, the caching host
    allocator keeping that pinned block until the copy has run (``host`` may change after the call)."""
    if host.device == device:
        return host
    if device.type != "cuda":
        return host.to(device)
    if torch.cuda.is_current_stream_capturing():  # a replay would re-read a pinned block reused since
        raise ValueError("cu_seqlens on the host cannot be captured in a CUDA graph: pass it on the tokens' device")
    staged = torch.empty(host.shape, dtype=host.dtype, pin_memory=True).copy_(host)
    return staged.to(device, non_blocking=True)


@dataclass(frozen=True)
class Segments:
    """The packed layout on the tokens' device: ``cu_seqlens`` (int64), ``ids [N]`` (each token's
    sequence); ``max_seqlen`` an int where it is known on the host, else a 0-dim tensor; ``host`` the
    ``cu_seqlens`` (int64) on the host where it was given there in eager mode (CPU tokens, or a host
    copy beside device tokens), else None: the sequences' ends, readable at no cost."""

    cu_seqlens: torch.Tensor
    ids: torch.Tensor
    tokens: int
    sequences: int
    max_seqlen: int | torch.Tensor
    host: torch.Tensor | None = None

    @classmethod
    def of(cls, cu_seqlens, tokens: int, device: torch.device, max_seqlen=None) -> Segments:
        """``cu_seqlens`` (on ``device`` or on the host) checked against ``tokens`` packed tokens on
        ``device``: a named error for anything else than 0, then non-decreasing ends, the last one
        ``tokens``.  On the host in eager mode the values are checked there (free), and a device's copy
        is made without a sync (``to_device``); on a device, and under torch.compile, they are checked
        on the device (``torch._assert_async``), without a host sync."""
        _check_cu_seqlens(cu_seqlens, tokens, device)
        if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int)):
            raise TypeError(f"max_seqlen must be None or an int, got {type(max_seqlen).__name__}")
        host = None
        if check.host_checks_free(cu_seqlens):
            host = cu_seqlens.long()
            _check_ends(host, tokens)
            host_lengths = host[1:] - host[:-1]
            longest = int(host_lengths.max()) if len(host_lengths) else 0
            if max_seqlen is not None and max_seqlen != longest:
                raise ValueError(f"max_seqlen must be the longest sequence's length {longest}, got {max_seqlen}")
            max_seqlen = longest
            ends = to_device(host, device)
            lengths = host_lengths if ends is host else ends[1:] - ends[:-1]
        else:
            ends = cu_seqlens.long().to(device)  # on the device, or on the host under torch.compile (copied there)
            lengths = ends[1:] - ends[:-1]
            ok = (ends[0] == 0) & (ends[-1] == tokens) & (lengths >= 0).all()
            torch._assert_async(ok, "cu_seqlens must start at 0, be non-decreasing and end at the packed tokens")
            if max_seqlen is not None:
                longest = lengths.max() if len(lengths) else ends.new_zeros(())
                torch._assert_async(longest == max_seqlen, "max_seqlen must be the longest sequence's length")
        sequences = len(lengths)
        ids = torch.repeat_interleave(torch.arange(sequences, device=device), lengths, output_size=tokens)
        if max_seqlen is None:
            max_seqlen = lengths.max() if sequences else ends.new_zeros(())
        return cls(ends, ids, tokens, sequences, max_seqlen, host)

    @property
    def lengths(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    def host_max_seqlen(self, op: str) -> int:
        """The longest length on the host, for a loop bound: given, or read from the device (a sync)."""
        if isinstance(self.max_seqlen, int):
            return self.max_seqlen
        if torch.compiler.is_compiling():
            raise ValueError(f"{op}: pass max_seqlen with cu_seqlens under torch.compile (the scan's bound)")
        return int(self.max_seqlen)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per-sequence sums ``[S, ...]`` of ``x [N, ...]``, each in token order on CPU."""
        return x.new_zeros((self.sequences, *x.shape[1:])).index_add(0, self.ids, x)

    def spread(self, per_sequence: torch.Tensor) -> torch.Tensor:
        """``[S, ...]`` -> ``[N, ...]``: each token gets its sequence's value."""
        return per_sequence.index_select(0, self.ids)

    def last_valid(self, mask: torch.Tensor) -> torch.Tensor:
        """``[S]`` the index (into ``[N]``) of each sequence's last valid token, -1 for none."""
        position = torch.where(mask, torch.arange(self.tokens, device=mask.device), -1)
        out = torch.full((self.sequences,), -1, dtype=torch.long, device=mask.device)
        return out.scatter_reduce(0, self.ids, position, "amax")


@dataclass
class Layout:
    """The padded detour: where each of the ``N`` packed tokens sits in the ``[S, width]`` layout."""

    rows: torch.Tensor  # [N]
    cols: torch.Tensor  # [N]
    sequences: int
    width: int

    @classmethod
    def of(cls, cu_seqlens, tokens: int, device: torch.device, op: str = "this op") -> Layout:
        _check_cu_seqlens(cu_seqlens, tokens, device)
        if torch.compiler.is_compiling():
            raise ValueError(
                f"cu_seqlens: {op} has no packed kernel on this backend, and its padded detour reads the "
                "lengths on the host, which torch.compile cannot trace: compile the padded [B, T] call, or "
                "call it outside the compiled region (docs/ops.md lists the packed kernels per backend)"
            )
        ends = cu_seqlens.long().cpu()  # the lengths are needed on the host (the padded width)
        _check_ends(ends, tokens)
        lengths = ends[1:] - ends[:-1]
        rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        cols = torch.arange(tokens) - ends[:-1].repeat_interleave(lengths)
        width = int(lengths.max()) if len(lengths) else 0
        return cls(rows.to(device), cols.to(device), len(lengths), width)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, ...]`` -> ``[S, width, ...]``, zeros (False) past each sequence's end; differentiable."""
        out = x.new_zeros((self.sequences, self.width, *x.shape[1:]))
        return out.index_put((self.rows, self.cols), x)

    def unpad(self, value):
        """The per-token tensors among an op's outputs (``[S, width, ...]``) back to ``[N, ...]``."""
        if isinstance(value, torch.Tensor):
            if value.dim() >= 2 and tuple(value.shape[:2]) == (self.sequences, self.width):
                return value[self.rows, self.cols]
            return value
        if isinstance(value, tuple):
            return tuple(self.unpad(v) for v in value)
        if isinstance(value, list):
            return [self.unpad(v) for v in value]
        if isinstance(value, dict):
            return {k: self.unpad(v) for k, v in value.items()}
        return value


def backend_of(op: str, device_type: str) -> str:
    """The name of the backend that serves ``op`` here (``resolve``'s choice), traceable by Dynamo."""
    from .backends import resolve

    return resolve(op, device_type).__module__.split(".")[2]


def one_row(value):
    """An op's outputs on the packed tokens as one ``[1, N]`` row: its per-token tensors back to ``[N]``."""
    if isinstance(value, torch.Tensor):
        return value[0] if value.dim() >= 2 and value.shape[0] == 1 else value
    if isinstance(value, (tuple, list)):
        return type(value)(one_row(v) for v in value)
    if isinstance(value, dict):
        return {k: one_row(v) for k, v in value.items()}
    return value


def _checked_tokens(bound, token_args) -> torch.Tensor:
    """The first per-token tensor, after checking that every one is packed like it."""
    first = bound.arguments.get(token_args[0])
    if not isinstance(first, torch.Tensor) or first.dim() < 1:
        raise ValueError(f"{token_args[0]} must be a packed [N, ...] tensor with cu_seqlens")
    tokens = first.shape[0]
    for name in token_args[1:]:
        x = bound.arguments.get(name)
        if x is None:
            continue
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != tokens:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"{name} must be packed like {token_args[0]}, [{tokens}, ...] with cu_seqlens, got {shape}"
            )
        if x.device != first.device:
            raise ValueError(f"{name} must be on {first.device} with {token_args[0]}, got {x.device}")
    return first


def varlen(*token_args: str, packed=None):
    """Give a sequence op the packed layout: keywords ``cu_seqlens`` and ``max_seqlen``;
    ``token_args`` name its per-token tensor arguments (``[N, ...]`` packed, the first one required).

    ``packed(segments, *args, **kwargs)`` computes the op on the packed tensors; it returns
    ``NotImplemented`` where it has no packed implementation (a backend without a segmented
    kernel), and the op then takes the padded detour.  ``op.padded`` always takes it."""

    def wrap(fn):
        signature = inspect.signature(fn)

        def detour(bound, cu_seqlens, first):
            layout = Layout.of(cu_seqlens, first.shape[0], first.device, fn.__name__)
            for name in token_args:
                if bound.arguments.get(name) is not None:
                    bound.arguments[name] = layout.pad(bound.arguments[name])
            return layout.unpad(fn(*bound.args, **bound.kwargs))

        @functools.wraps(fn)
        def op(*args, cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None, **kwargs):
            if cu_seqlens is None:
                if max_seqlen is not None:
                    raise ValueError("max_seqlen is the packed layout's: pass it with cu_seqlens")
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            first = _checked_tokens(bound, token_args)
            if packed is not None:
                segments = Segments.of(cu_seqlens, first.shape[0], first.device, max_seqlen)
                result = packed(segments, *bound.args, **bound.kwargs)
                if result is not NotImplemented:
                    return result
            return detour(bound, cu_seqlens, first)

        @functools.wraps(fn)
        def padded(*args, cu_seqlens: torch.Tensor, **kwargs):
            bound = signature.bind(*args, **kwargs)
            return detour(bound, cu_seqlens, _checked_tokens(bound, token_args))

        parameters = list(signature.parameters.values())
        keywords = [
            inspect.Parameter(
                "cu_seqlens", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="torch.Tensor | None"
            ),
            inspect.Parameter("max_seqlen", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="int | None"),
        ]
        at = next((i for i, p in enumerate(parameters) if p.kind is inspect.Parameter.VAR_KEYWORD), len(parameters))
        op.__signature__ = signature.replace(parameters=[*parameters[:at], *keywords, *parameters[at:]])
        op.__doc__ = (fn.__doc__ or "") + (
            "\n\n        With ``cu_seqlens`` (and optionally ``max_seqlen``): the packed layout "
            f"(``ppo_fast._varlen``), the per-token tensors ({', '.join(token_args)}) ``[N, ...]``."
        )
        op.padded = padded
        return op

    return wrap
