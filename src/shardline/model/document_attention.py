"""Attention over packed rows that only computes what the document mask keeps.

A packed row holds several documents; each token may only see earlier tokens of its own document.
Hugging Face's `sdpa` path builds that as a dense block-diagonal [T, T] mask, so the kernel computes all
T² query-key pairs and throws most away (rows of 512 tokens holding ~92-token documents keep 1/11 of
them), and CPU SDPA runs far slower with an explicit mask than with `is_causal`.

`document_sdpa` runs SDPA per document, causal, with no mask (documents of one rounded length batched
into one call): the work is Σ len² instead of T² per row and the fast causal kernels apply (CPU flash, CUDA
flash/cuDNN/efficient). The documents come from
`shardline.data.spans` (a document starts where its position is 0), passed to the model as the same
varlen keywords flash-attention-2 reads (`cu_seq_lens_q`, …), so `flash_attention_2` on GPU takes the
same spans with no work of its own. Without spans (generation, evaluation with padding) the
function is plain `sdpa`, masks and all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from shardline.data.spans import DocumentSpans
from shardline.errors import SpecError

NAME = "shardline_document_sdpa"
"""The implementation's key in transformers' attention registry; specs say `sdpa`."""


LENGTH_BUCKET = 32
"""Each document's span is rounded up to a multiple of this many tokens, and documents of one rounded
length run as one batched SDPA call: a handful of calls per layer instead of one per document, and a
bounded set of shapes (the CPU flash kernels build and keep one kernel per sequence length: ~3 MB each in
bf16, measured, so raw lengths grew memory with every new length). The causal mask keeps the extra tokens
(the start of the next document) out of the real queries' view, and their own outputs are dropped."""


@dataclass(frozen=True)
class _Bucket:
    """Documents of one rounded length: where their tokens are and which of the rounded slots are real."""

    span: int
    docs: int
    gather: torch.Tensor
    """[docs·span] token positions on the flat (padded) token axis, document after document."""
    real: torch.Tensor
    """Positions in [docs·span] that hold the documents' own tokens, not the rounding."""
    mask: torch.Tensor | None
    """[span, span] causal sliding-window mask when the model's window is shorter than the span, else None
    (plain causal: a document no longer than the window sees all of its past either way)."""


@dataclass(frozen=True)
class _Plan:
    buckets: tuple[_Bucket, ...]
    order: torch.Tensor
    """Puts the buckets' real tokens, concatenated, back in token order."""


def window_mask(span: int, window: int) -> torch.Tensor:
    """Query i sees key j when j ≤ i and i − j < window: transformers' `sliding_window_overlay` on causal."""
    i, j = torch.arange(span)[:, None], torch.arange(span)[None, :]
    return (j <= i) & (i - j < window)


@functools.lru_cache(maxsize=8)
def _plan(lengths: tuple[int, ...], device: torch.device, window: int | None = None) -> _Plan:
    """The gather/scatter indices of one batch's spans, built once on the CPU and shared by every layer (and
    the backward): on a GPU every index is copied once, asynchronously, and no layer waits for the device
    (index building or boolean masks on the device synchronise with it, once per bucket per layer)."""
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    sizes = torch.tensor(lengths)
    rounded = (sizes + LENGTH_BUCKET - 1) // LENGTH_BUCKET * LENGTH_BUCKET
    buckets, positions = [], []
    for span in rounded.unique().tolist():
        docs = (rounded == span).nonzero().flatten()
        offsets = torch.arange(span)
        gather = (starts[docs, None] + offsets).flatten()
        real = (offsets < sizes[docs, None]).flatten().nonzero().flatten()
        buckets.append((span, len(docs), gather, real))
        positions.append(gather[real])
    order = torch.cat(positions).argsort()

    def move(x: torch.Tensor) -> torch.Tensor:
        return x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x.to(device)

    return _Plan(tuple(_Bucket(span, n, move(g), move(r),
                               move(window_mask(span, window)) if window is not None and span > window else None)
                       for span, n, g, r in buckets), move(order))


def prepare(spans: DocumentSpans, device: torch.device) -> None:
    """Build (and cache) the index plan of these spans now, on real tensors: the dry run's step on fake tensors
    (`shardline.training.step_memory`) cannot compute indices, and finds them cached."""
    _plan(tuple(spans.lengths), device, None)  # the key document_sdpa asks for


@torch.compiler.disable  # data-dependent spans: compiled blocks run around this
def _per_document(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int],
                  scaling: float | None, gqa: bool, window: int | None = None) -> torch.Tensor:
    b, h, t, d = query.shape
    n_tokens = b * t
    # [B, H, T, D] → [H, B·T (+ room to round the last span up), D]: documents are contiguous spans.
    q, k, v = (F.pad(x.transpose(0, 1).reshape(x.shape[1], n_tokens, d), (0, 0, 0, LENGTH_BUCKET - 1))
               for x in (query, key, value))
    plan = _plan(tuple(lengths), query.device, window)
    outputs = []
    for bucket in plan.buckets:
        # [H, docs·span, D] → [docs, H, span, D]: one batch of equal-length causal sequences.
        qb, kb, vb = (x.index_select(1, bucket.gather).unflatten(1, (bucket.docs, bucket.span)).transpose(0, 1)
                      for x in (q, k, v))
        if bucket.mask is None:
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:  # the model's sliding window is shorter than these documents
            out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=bucket.mask, scale=scaling, enable_gqa=gqa)
        outputs.append(out.transpose(0, 1).reshape(out.shape[1], -1, d).index_select(1, bucket.real))
    # Every token is in exactly one span: put the pieces back in token order.
    merged = torch.cat(outputs, 1).index_select(1, plan.order)  # [H, B·T, D]
    # [H, B·T, D] → [B, T, H, D], the layout HF attention functions return.
    return merged.reshape(h, b, t, d).permute(1, 2, 0, 3).contiguous()


def document_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention function: per-document causal SDPA when spans are given, else `sdpa` unchanged."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[2] == 1 or dropout > 0.0:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise SpecError("model.attn_implementation", f"{type(module).__name__} caps its attention logits or adds "
                        "attention sinks, which per-document SDPA cannot compute", "set model.attn_implementation="
                        "eager (or flash_attention_2 on a GPU) for this model")
    bounds = cu.tolist()  # spans stay on the CPU for this path: no device sync (and no tensor op: a dry run's fake
    lengths = [end - start for start, end in zip(bounds, bounds[1:], strict=False)]  # step reads them too)
    gqa = key.shape[1] != query.shape[1]
    window = kwargs.get("sliding_window")  # Mistral, Qwen2, Gemma's local layers: honoured, never dropped
    return _per_document(query, key, value, lengths, scaling, gqa, int(window) if window else None), None


def register() -> None:
    """Make `NAME` known to transformers (idempotent); its masks, when one is needed, are sdpa's."""
    AttentionInterface.register(NAME, document_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
