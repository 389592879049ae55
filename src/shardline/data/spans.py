"""Where the documents are in a batch of packed rows.

Packing restarts position ids at 0 for every document (and for a row's padding tail), so the spans follow
from the positions. They drive document-masked attention (varlen keywords for the model) and the
attention term of the FLOPs count (Σ len² per document instead of T² per row; `shardline.model.flops` counts the
pairs of a sliding-window layer with `window_pairs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def window_causal_pairs(length: int, window: int | None) -> int:
    """Causal query-key pairs of one `length`-token document: Σ over queries of the keys they see,
    min(i + 1, window) with a sliding `window`."""
    if not window or length <= window:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def window_pairs(length: int, window: int | None) -> int:
    """The same without causal halving, the band |i − j| < window of the len × len square: len² without a
    window (2·causal − len, the diagonal counted once)."""
    return 2 * window_causal_pairs(length, window) - length


@dataclass(frozen=True)
class DocumentSpans:
    """Documents of a [B, T] batch of packed rows, as offsets into the flattened B·T tokens (CPU)."""

    cu_seqlens: torch.Tensor  # int32 [n_spans + 1]; every token is in one span, padding tails included
    lengths: tuple[int, ...]
    real: tuple[bool, ...]  # False for a row's padding tail

    def model_kwargs(self, device: torch.device) -> dict:
        """The varlen keywords HF models pass through to the attention function, offsets on `device`."""
        cu = self.cu_seqlens.to(device, non_blocking=True)
        longest = max(self.lengths)
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}

    @property
    def pairs(self) -> int:
        """Query-key pairs the document mask allows, without causal halving: Σ len² over real documents."""
        return sum(n * n for n, real in zip(self.lengths, self.real, strict=True) if real)

    @property
    def causal_pairs(self) -> int:
        """The same with the causal half only: Σ len·(len+1)/2 over real documents."""
        return sum(n * (n + 1) // 2 for n, real in zip(self.lengths, self.real, strict=True) if real)

    def window_pairs(self, window: int, causal: bool = False) -> int:
        """`pairs` (or `causal_pairs`) on a layer that sees at most `window` keys back."""
        count = window_causal_pairs if causal else window_pairs
        return sum(count(n, window) for n, real in zip(self.lengths, self.real, strict=True) if real)

    def executed_causal_pairs(self, bucket: int = 1) -> int:
        """What a per-document causal kernel computes: padding tails are spans too, and each span is
        rounded up to a multiple of `bucket` tokens (see `shardline.model.document_attention`)."""
        rounded = (-(-n // bucket) * bucket for n in self.lengths)
        return sum(n * (n + 1) // 2 for n in rounded)


def document_spans(position_ids: torch.Tensor, n_real: torch.Tensor) -> DocumentSpans:
    """Spans of [B, T] positions that restart at 0 for every document; row r's tokens from `n_real[r]` on
    are padding. A row boundary always starts a span."""
    rows, seq = position_ids.shape
    flat = position_ids.reshape(-1).cpu()
    starts = torch.nonzero(flat == 0).flatten()
    row_starts = torch.arange(0, rows * seq, seq)
    bounds = torch.unique(torch.cat([starts, row_starts, torch.tensor([rows * seq])]))
    lengths = (bounds[1:] - bounds[:-1]).tolist()
    real_ends = row_starts + n_real.cpu().long()
    real = [bool(start < real_ends[start // seq]) for start in bounds[:-1].tolist()]
    return DocumentSpans(bounds.to(torch.int32), tuple(lengths), tuple(real))
