"""The packed (varlen) layout of the sequence ops: flash-attn's convention.

Instead of ``[B, T]`` tensors and a mask padded to the longest row, a sequence op takes its
per-token tensors as ``[N, ...]`` (the ``S`` sequences' tokens one after another) and
``cu_seqlens`` ``[S + 1]`` (int32 or int64, on their device): 0, then each sequence's end.  The mask
keeps its meaning inside a sequence (a tool output inside a response); sequence-level inputs
(``kl_penalized_rewards``' scores) stay ``[S]``.

Each op runs its padded implementation, on whichever backend serves it, on the sequences laid
out as ``[S, max length]`` rows (masked out past each end), and its per-token outputs are read
back as ``[N, ...]``: a packed result is the padded layout's result at the valid tokens, in value
and in every gradient, bit for bit.  The cost is one gather and one scatter of the per-token
tensors; reading ``cu_seqlens`` (its lengths) synchronises a CUDA device with the host once.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

CU_SEQLENS_DTYPES = (torch.int32, torch.int64)


@dataclass
class Layout:
    """Where each of the ``N`` packed tokens sits in the ``[S, width]`` padded layout."""

    rows: torch.Tensor  # [N]
    cols: torch.Tensor  # [N]
    sequences: int
    width: int

    @classmethod
    def of(cls, cu_seqlens, tokens: int, device: torch.device) -> Layout:
        """``cu_seqlens`` checked against ``tokens`` packed tokens on ``device``: a named error for
        anything else than 0, then non-decreasing ends, the last one ``tokens``."""
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
        if cu_seqlens.dtype not in CU_SEQLENS_DTYPES:
            raise TypeError(
                f"cu_seqlens must have dtype int32 or int64, got {str(cu_seqlens.dtype).replace('torch.', '')}"
            )
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens must be 1-D [S + 1] with S >= 0, got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.device != device:
            raise ValueError(f"cu_seqlens must be on the tokens' device {device}, got {cu_seqlens.device}")
        ends = cu_seqlens.tolist()  # the lengths are needed on the host (the padded width)
        if ends[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {ends[0]}")
        if any(b < a for a, b in zip(ends, ends[1:])):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {ends[:8]}{' ...' if len(ends) > 8 else ''}")
        if ends[-1] != tokens:
            raise ValueError(f"cu_seqlens must end at the number of packed tokens {tokens}, got {ends[-1]}")
        lengths = torch.tensor([b - a for a, b in zip(ends, ends[1:])], dtype=torch.long)
        rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        cols = torch.arange(tokens) - torch.tensor(ends[:-1], dtype=torch.long).repeat_interleave(lengths)
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


def varlen(*token_args: str):
    """Give a sequence op the packed layout: a keyword ``cu_seqlens``; ``token_args`` name its
    per-token tensor arguments (``[N, ...]`` packed, the first one required)."""

    def wrap(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def op(*args, cu_seqlens: torch.Tensor | None = None, **kwargs):
            if cu_seqlens is None:
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            first = bound.arguments.get(token_args[0])
            if not isinstance(first, torch.Tensor) or first.dim() < 1:
                raise ValueError(f"{token_args[0]} must be a packed [N, ...] tensor with cu_seqlens")
            tokens = first.shape[0]
            layout = Layout.of(cu_seqlens, tokens, first.device)
            for name in token_args:
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
                bound.arguments[name] = layout.pad(x)
            return layout.unpad(fn(*bound.args, **bound.kwargs))

        parameters = list(signature.parameters.values())
        keyword = inspect.Parameter(
            "cu_seqlens", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="torch.Tensor | None"
        )
        at = next((i for i, p in enumerate(parameters) if p.kind is inspect.Parameter.VAR_KEYWORD), len(parameters))
        op.__signature__ = signature.replace(parameters=[*parameters[:at], keyword, *parameters[at:]])
        op.__doc__ = (fn.__doc__ or "") + (
            "\n\n        With ``cu_seqlens``: the packed layout (``ppo_fast._varlen``), the per-token tensors "
            f"({', '.join(token_args)}) ``[N, ...]``."
        )
        return op

    return wrap
