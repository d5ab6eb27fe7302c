"""Padding-free forward passes: a micro-batch's real tokens packed into fewer, full rows.

A batch of rollouts is ``[B, P + R]`` with the prompts padded on the left and the responses on
the right.  Packed, its rows' real tokens (each row's are contiguous) are placed, longest first,
into the first of ``K <= B`` bins of the same width ``P + R`` that has room (first-fit
decreasing), ``position_ids`` restarting at 0 for each row and for a bin's unused tail (a
sequence of its own that scores nothing); with no attention mask and no cache, transformers
keeps attention inside each sequence (its packed-sequence masks, found from the restarts).  Bins
of the padded width rather than one ``[1, N]`` sequence: attention that masks a whole row
(sdpa, eager) costs ``K (P + R)^2``, never more than the padded layout's, where one sequence
would cost ``N^2``.  The response tokens are scored from the ``M`` packed positions that precede
them, and the per-token results are spread back into the ``[B, R]`` layout the losses take
(zeros outside the response mask, where the padded layout held values no loss reads).  The one-pass
loss skips that spread: it takes the ``M`` scored tokens as packed sequences themselves (``ppo_fast._varlen``),
one per response in row order (``cu_seqlens``), with its ``[B, R]`` inputs gathered to them (``gather``).

Whether a model's attention really keeps to each sequence is checked once, at start-up
(``problem``): a model that attends across the restarts would train on other rows' tokens.  A
micro-batch is packed only where padding is a large share of it (``worth_packing``); the choice
depends on its mask alone, so the old log-probs and the update's first micro-batch make the same one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

# A micro-batch is packed when its real tokens are at most this share of its padded layout: rows of
# nearly equal length (the built-in task's) fill a bin each, and packing them would only cost its copies.
PACK_BELOW = 0.75


def worth_packing(attention_mask: torch.Tensor) -> bool:
    """Whether ``attention_mask``'s ``[B, T]`` layout is padded enough to pack (``PACK_BELOW``)."""
    return int(attention_mask.sum()) <= PACK_BELOW * attention_mask.numel()


@dataclass
class Padded:
    """The padded ``[B, P + R]`` layout behind the same interface as ``Packed``: the model's inputs,
    the positions that score the response (``pick``), their labels, and ``spread`` (nothing to do)."""

    inputs: dict
    start: int  # the position before the first response token
    labels: torch.Tensor  # [B, R]

    def pick(self, per_position: torch.Tensor) -> torch.Tensor:
        """``[B, P + R, ...]`` -> ``[B, R, ...]``: the logits at position t predict token t + 1."""
        return per_position[:, self.start : -1]

    def spread(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        return values

    cu_seqlens = None  # the rows are the sequences


def layout(input_ids, attention_mask, position_ids, response_ids, packed: bool) -> Padded | Packed:
    """The rows as the model will see them: packed (``pack``) or padded."""
    if packed:
        return pack(input_ids, attention_mask, response_ids.shape[1])
    inputs = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "use_cache": False,
    }
    return Padded(inputs, input_ids.shape[1] - response_ids.shape[1] - 1, response_ids)


@dataclass
class Packed:
    """A batch's real tokens in ``K`` full rows, and where its scored response tokens go."""

    input_ids: torch.Tensor  # [K, P + R]
    position_ids: torch.Tensor  # [K, P + R], from 0 in each packed row and each bin's tail
    scored: torch.Tensor  # [M]: the (flattened) packed positions whose hidden states score a response token
    labels: torch.Tensor  # [M]: the response tokens they score
    rows: torch.Tensor  # [M]: each scored token's row ...
    cols: torch.Tensor  # [M]: ... and response column in the [B, R] layout
    shape: tuple[int, int]  # (B, R)
    # [B + 1] int64 on the host, whatever the tokens' device: the scored tokens as packed sequences
    # (ppo_fast._varlen), each row's response one, in row order.  On the host, the ops check it there and
    # copy it without a sync, and a sequence-level loss (gspo, geo_mean) keeps its one pass on CUDA.
    cu_seqlens: torch.Tensor

    @property
    def inputs(self) -> dict:
        """The model's keywords: no mask and no cache, so that transformers finds the restarts."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "attention_mask": None,
            "use_cache": False,
        }

    def pick(self, per_position: torch.Tensor) -> torch.Tensor:
        """``[K, P + R, ...]`` -> ``[M, ...]``: the positions that score a response token."""
        return per_position.flatten(0, 1)[self.scored]

    def spread(self, values: torch.Tensor) -> torch.Tensor:
        """``[M, ...]`` per scored token -> ``[B, R, ...]`` (zeros elsewhere), differentiably."""
        out = values.new_zeros((*self.shape, *values.shape[1:]))
        return out.index_put((self.rows, self.cols), values)

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """``[B, R, ...]`` -> ``[M, ...]``: the values at the scored tokens, in their packed order (``spread``'s inverse)."""
        return values[self.rows, self.cols]


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_width: int) -> Packed:
    """``input_ids`` / ``attention_mask`` ``[B, P + R]`` (each row's real tokens contiguous: a
    left-padded prompt, then a response up to its EOS) packed into bins; the last ``response_width``
    columns are the responses."""
    mask = attention_mask.bool()
    rows_n, width = input_ids.shape
    prompt = width - response_width
    response = mask[:, prompt:]
    # One read of the device: the rows' real tokens (the bins are planned on the host) and their responses'
    # (the host cu_seqlens, whose ends the one-pass loss reads at no cost: ``Packed.cu_seqlens``).
    lengths, counts = torch.stack([mask.sum(1), response.sum(1)]).tolist()
    bins = token_bins(lengths, width)
    starts, used = [0] * rows_n, []  # each row's flat packed start; each bin's filled width
    for slot, bin_rows in enumerate(bins):
        used.append(slot * width)
        for row in sorted(bin_rows.tolist(), key=lambda r: -lengths[r]):  # as placed: longest first
            starts[row], used[-1] = used[-1], used[-1] + lengths[row]
    within = mask.long().cumsum(-1) - 1  # each real token's place in its row
    index = torch.tensor(starts, device=mask.device)[:, None] + within  # ... and its flat packed position
    flat = len(bins) * width
    ids = input_ids.new_zeros(flat).index_put((index[mask],), input_ids[mask])
    # A bin's tail counts up from 0 as a sequence of its own (nothing reads its outputs).
    filled = (torch.tensor(used, device=mask.device) % width).repeat_interleave(width)
    positions = torch.arange(flat, device=mask.device) % width
    positions = torch.where(positions >= filled, positions - filled, positions).index_put((index[mask],), within[mask])
    rows, cols = response.nonzero(as_tuple=True)  # row-major: each row's response tokens together, in row order
    return Packed(
        input_ids=ids.view(len(bins), width),
        position_ids=positions.view(len(bins), width),
        scored=index[rows, prompt - 1 + cols],  # the token before each response token
        labels=input_ids[rows, prompt + cols],
        rows=rows,
        cols=cols,
        shape=(rows_n, response_width),
        cu_seqlens=torch.tensor([0, *itertools.accumulate(counts)]),
    )


def token_bins(lengths: list[int], budget: int) -> list[torch.Tensor]:
    """Positions in ``lengths`` binned first-fit decreasing so that each bin sums to at most ``budget``
    (a longer item alone); each bin in ascending position order, the bins in the order they opened."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fit = next((b for b, load in enumerate(loads) if load + lengths[i] <= budget), None)
        if fit is None:
            bins.append([i])
            loads.append(lengths[i])
        else:
            bins[fit].append(i)
            loads[fit] += lengths[i]
    return [torch.tensor(sorted(b), dtype=torch.long) for b in bins]


@torch.no_grad()
def problem(model: torch.nn.Module, device: torch.device) -> str | None:
    """None when ``model``'s packed logits of two sequences, in two packed rows of a batch (``pack``'s
    layout), equal their logits alone (to float32 rounding); else what differs (its attention crosses
    the restarts)."""
    vocab = model.get_output_embeddings().weight.shape[0] if hasattr(model, "get_output_embeddings") else None
    vocab = vocab or getattr(getattr(model, "config", None), "vocab_size", None) or 2
    training = model.training
    model.eval()  # dropout would make any two passes differ
    generator = torch.Generator().manual_seed(0)
    first, second = (torch.randint(vocab, (1, n), generator=generator).to(device) for n in (6, 5))
    alone = [model(input_ids=ids, use_cache=False).logits.float() for ids in (first, second)]
    positions = torch.stack(
        [torch.cat([torch.arange(6), torch.arange(5)]), torch.cat([torch.arange(5), torch.arange(6)])]
    )
    packed = model(
        input_ids=torch.cat([torch.cat([first, second], 1), torch.cat([second, first], 1)]),
        position_ids=positions.to(device),
        attention_mask=None,
        use_cache=False,
    ).logits.float()
    model.train(training)
    pieces = [
        (packed[:1, :6], alone[0]),
        (packed[:1, 6:], alone[1]),
        (packed[1:, :5], alone[1]),
        (packed[1:, 5:], alone[0]),
    ]
    worst = max((got - want).abs().max().item() for got, want in pieces)
    scale = max(alone[0].abs().max().item(), alone[1].abs().max().item(), 1.0)
    low_precision = next(model.parameters()).dtype in (torch.bfloat16, torch.float16)
    if worst <= (3e-2 if low_precision else 1e-4) * scale:
        return None
    return (
        f"{type(model).__name__}'s attention crosses the sequences of a packed batch (logits off by {worst:.3g}): "
        "its transformers version or attention implementation does not mask packed sequences from position_ids"
    )
