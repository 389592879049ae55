"""Attention over packed rows that only computes what the document mask keeps.

A packed row holds several documents; each token may only see earlier tokens of its own document.
Hugging Face's `sdpa` path builds that as a dense block-diagonal [T, T] mask, so the kernel computes all
T² query-key pairs and throws most away (rows of 512 tokens holding ~92-token documents keep 1/11 of
them), and CPU SDPA runs far slower with an explicit mask than with `is_causal`.

`document_sdpa` runs SDPA per document, causal, with no mask (documents of one rounded length batched
into one call): the work is Σ len² instead of T² per row and the fast causal kernels apply (CPU flash, CUDA
flash/cuDNN/efficient). On CUDA in bf16/fp16, rows longer than `DENSE_MAX_SEQ` run one variable-length flash
call per layer over all the batch's documents instead (torch's `varlen_attn`, the offsets as `cu_seqlens`). The
documents come from
`shardline.data.spans` (a document starts where its position is 0), passed to the model as the same
varlen keywords flash-attention-2 reads (`cu_seq_lens_q`, …), so `flash_attention_2` on GPU takes the
same spans with no work of its own. Without spans (generation, evaluation with padding) the
function is plain `sdpa`, masks and all. Each family's own attention semantics are kept: sliding windows (a
banded mask), Gemma 2's logit soft-capping (capped scores, materialised per document); attention sinks, which
no path here computes, are a named error.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from shardline.data.spans import DocumentSpans
from shardline.errors import SpecError

NAME = "shardline_document_attention"
"""The implementation's key in transformers' attention registry; specs say `sdpa`. The key must not contain
"sdpa": transformers then checks the model class's own SDPA support, which Gemma 2 lacks (its soft-capping),
and refuses a function that computes it."""


LENGTH_BUCKET = 32
"""Each document's span is rounded up to a multiple of this many tokens, and documents of one rounded
length run as one batched SDPA call: a handful of calls per layer instead of one per document, and a
bounded set of shapes (the CPU flash kernels build and keep one kernel per sequence length: ~3 MB each in
bf16, measured, so raw lengths grew memory with every new length). The causal mask keeps the extra tokens
(the start of the next document) out of the real queries' view, and their own outputs are dropped."""


CUDNN_MIN_SPAN = 4096
"""On CUDA, buckets shorter than this run SDPA's flash/efficient kernels, never cuDNN's. Measured on an H200
(torch 2.11, bench/RESULTS-gpu.md): a cuDNN attention call costs ~1.4 ms of host time, forward and backward
alike, as the buckets' batch sizes change every step; 80 bucketed calls a step on a 0.8B model at 16 × 512
tokens kept the GPU idle behind the host (0.32 s steps, HF Trainer's dense mask 0.15 s). On long spans a call's
GPU time dwarfs that cost, and cuDNN's kernel is the faster one on Hopper (3.6 vs 6.8 ms at 8192 tokens)."""


def sdpa_backends(span: int, device: torch.device) -> list[SDPBackend] | None:
    """The SDPA backends a bucket of this span may use on this device; None: SDPA's own choice."""
    if device.type != "cuda" or span >= CUDNN_MIN_SPAN:
        return None
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


DENSE_MAX_SEQ = 1024
"""On CUDA, rows of at most this many tokens run one SDPA call per layer with the dense block-diagonal mask
(what transformers' `sdpa` does), not per-document buckets: at 16 × 512 tokens on an H200 the buckets' ~10
launches each cost more host time than the mask's wasted pairs cost the GPU (bench/RESULTS-gpu.md). At 1024
tokens (H100) one varlen flash call is 1.23× the mask on attention alone, but the mask keeps a compiled block one
graph; longer rows take varlen or the buckets, whose saving grows with the row (T² against Σ len²)."""


def uses_dense_mask(seq: int, device: torch.device) -> bool:
    """Whether packed rows of `seq` tokens run as whole rows with the block-diagonal mask (all T² pairs computed)."""
    return device.type == "cuda" and seq <= DENSE_MAX_SEQ


VARLEN_DTYPES = (torch.bfloat16, torch.float16)
"""Dtypes torch's variable-length flash kernel takes (it has no fp32 kernel)."""


@functools.lru_cache(maxsize=1)
def _varlen_kernel() -> tuple[Callable, frozenset[str]] | None:
    """torch's `varlen_attn` and the keywords this torch's version takes; None where it has none (before 2.10) or
    takes no window (2.10: `is_causal` instead)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    keywords = frozenset(inspect.signature(varlen_attn).parameters)
    return (varlen_attn, keywords) if "window_size" in keywords else None


def takes_varlen(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether packed rows longer than `DENSE_MAX_SEQ` run one variable-length flash call per layer (on layers
    without soft-capping): CUDA, bf16 or fp16, head dims flash takes, and a torch that has the op."""
    return (device.type == "cuda" and dtype in VARLEN_DTYPES and head_dim <= 256 and head_dim % 8 == 0
            and _varlen_kernel() is not None)


def uses_varlen(query: torch.Tensor) -> bool:
    """`takes_varlen` for this [B, H, T, D] query."""
    return takes_varlen(query.device, query.dtype, query.shape[-1])


@functools.lru_cache(maxsize=8)
def _device_offsets(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The spans' int32 offsets on the device, copied once per batch from pinned memory without waiting for it."""
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return cu.pin_memory().to(device, non_blocking=True)


@torch.compiler.disable  # data-dependent spans and maximum length: compiled blocks run around this
def _varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: tuple[int, ...],
            scaling: float | None, gqa: bool, window: int | None = None) -> torch.Tensor:
    """Every document of the batch in one causal flash call (banded by a sliding window); [B, T, H, D]."""
    kernel, keywords = _varlen_kernel()
    b, h, t, d = query.shape
    if gqa and "enable_gqa" not in keywords:  # this torch's op wants equal head counts
        key, value = (x.repeat_interleave(h // x.shape[1], dim=1) for x in (key, value))
    # [B, H, T, D] → [B·T, H, D]: the documents are contiguous spans of the flattened rows
    q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (query, key, value))
    cu = _device_offsets(lengths, query.device)
    longest = max(lengths)
    extra = {"enable_gqa": True} if gqa and "enable_gqa" in keywords else {}
    out = kernel(q, k, v, cu, cu, longest, longest, scale=scaling,
                 window_size=(window - 1, 0) if window and window < longest else (-1, 0), **extra)
    return out.reshape(b, t, h, d)


@functools.lru_cache(maxsize=8)
def _block_mask(lengths: tuple[int, ...], rows: int, seq: int, device: torch.device,
                window: int | None = None) -> torch.Tensor | None:
    """[rows, 1, seq, seq]: query i sees key j of its own document with j ≤ i (and i − j < window); None when
    a document crosses a row boundary (then only the buckets are exact). Built on the CPU, copied once."""
    bounds = torch.tensor([0, *lengths]).cumsum(0)
    if not set(range(0, rows * seq + 1, seq)) <= set(bounds.tolist()):
        return None
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).view(rows, seq)
    mask = (doc[:, :, None] == doc[:, None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    if window is not None:
        mask &= window_mask(seq, window)
    mask = mask[:, None]
    return mask.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else mask.to(device)


DENSE_MASKS = "document_masks"
"""The model keyword that carries the dense path's block-diagonal masks, built before the forward (`dense_masks`):
the attention function then reads no span offsets on the host, so a compiled block (`parallel.compile`) runs the
whole attention in its graph instead of breaking it at every layer."""


def mask_placeholder(rows: int, device: torch.device) -> torch.Tensor:
    """The `attention_mask` for a forward with spans: [rows, 1, 1, 1], which transformers passes through untouched
    (a 4D mask counts as prepared). With spans this attention never reads a mask, so transformers' own is never
    built: its packed-sequence check reads `position_ids` on the host (a device sync per forward) and its
    [rows, 1, T, T] block mask would take 1 GiB a forward at 32,768 tokens."""
    return torch.ones(rows, 1, 1, 1, dtype=torch.bool, device=device)


HOST_OFFSETS = "document_offsets"
"""The model keyword that carries the varlen offsets for this attention, which reads them on the host: in a
`HostOffsets`, since FSDP's root module moves every tensor argument to the device (on a GPU a synchronising copy
per offset tensor and forward, then a read back in every layer) but passes other objects through."""


class HostOffsets:
    """The span offsets of a batch (`DocumentSpans.cu_seqlens`, int32 on the CPU), out of FSDP's reach: a tensor
    still (not ints), so that a compiled block breaks at reading them instead of recompiling for every batch."""

    __slots__ = ("cu_seqlens",)

    def __init__(self, cu_seqlens: torch.Tensor) -> None:
        self.cu_seqlens = cu_seqlens


WHOLE_ROWS = "document_rows"
"""The model keyword saying that every row is one document, all of it real (`whole_rows`): attention is then plain
causal SDPA over each row, with no mask, no gather and no span offsets read on the host, so a compiled block stays
one graph. Long single-document rows (pre-training style data, NeMo's and torchtitan's protocols) take it."""


def whole_rows(spans: DocumentSpans, rows: int) -> bool:
    """Whether each of `rows` rows holds one document and no padding (a row boundary always starts a span, and a
    padding tail is a span of its own)."""
    return len(spans.lengths) == rows and all(spans.real)


def dense_masks(spans: DocumentSpans, rows: int, seq: int, device: torch.device,
                windows: tuple[int | None, ...]) -> dict[int, torch.Tensor] | None:
    """The dense path's masks of these spans for each layer window (key 0: no window), on `device`; None when a
    document crosses a row boundary (then only the per-document buckets are exact)."""
    masks = {window or 0: _block_mask(tuple(spans.lengths), rows, seq, device, window) for window in set(windows)}
    return None if any(mask is None for mask in masks.values()) else masks


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


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scaling: float | None,
                      softcap: float) -> torch.Tensor:
    """Gemma 2's attention: scores capped by softcap·tanh(s/softcap) before the mask (`keep`: True where a
    query sees a key) and an fp32 softmax, as transformers' eager function computes it. No SDPA kernel caps
    its scores, so the scores are materialised: per document on packed rows, [Q, K] otherwise."""
    if k.shape[1] != q.shape[1]:  # GQA: repeat the key/value heads as transformers' `repeat_kv` does
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scores = torch.matmul(q, k.transpose(2, 3)) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~keep, torch.finfo(scores.dtype).min)
    return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _causal_keep(queries: int, keys: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[Q, K]: the last `queries` positions of `keys` see their past (within `window`)."""
    i = torch.arange(keys - queries, keys, device=device)[:, None]
    j = torch.arange(keys, device=device)[None, :]
    return (j <= i) & (i - j < window) if window else j <= i


def prepare(spans: DocumentSpans, device: torch.device, windows: tuple[int | None, ...] = (None,)) -> None:
    """Build (and cache) the index plans of these spans now, on real tensors, for each of the model's layer
    windows: the dry run's step on fake tensors (`shardline.planning.simulation.step_memory`) cannot compute
    indices, and finds them cached."""
    for window in set(windows) or {None}:
        _plan(tuple(spans.lengths), device, window)  # the keys document_sdpa asks for


@torch.compiler.disable  # data-dependent spans: compiled blocks run around this
def _per_document(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: tuple[int, ...],
                  scaling: float | None, gqa: bool, window: int | None = None,
                  softcap: float | None = None) -> torch.Tensor:
    b, h, t, d = query.shape
    n_tokens = b * t
    # [B, H, T, D] → [H, B·T (+ room to round the last span up), D]: documents are contiguous spans.
    q, k, v = (F.pad(x.transpose(0, 1).reshape(x.shape[1], n_tokens, d), (0, 0, 0, LENGTH_BUCKET - 1))
               for x in (query, key, value))
    plan = _plan(lengths, query.device, window)
    outputs = []
    for bucket in plan.buckets:
        # [H, docs·span, D] → [docs, H, span, D]: one batch of equal-length causal sequences.
        qb, kb, vb = (x.index_select(1, bucket.gather).unflatten(1, (bucket.docs, bucket.span)).transpose(0, 1)
                      for x in (q, k, v))
        if softcap is not None:
            keep = bucket.mask if bucket.mask is not None else _causal_keep(bucket.span, bucket.span, None, q.device)
            out = _capped_attention(qb, kb, vb, keep, scaling, softcap)
        else:
            backends = sdpa_backends(bucket.span, q.device)
            with sdpa_kernel(backends) if backends else nullcontext():
                # a sliding window shorter than these documents is a mask; else plain causal
                out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=bucket.mask, is_causal=bucket.mask is None,
                                                     scale=scaling, enable_gqa=gqa)
        outputs.append(out.transpose(0, 1).reshape(out.shape[1], -1, d).index_select(1, bucket.real))
    # Every token is in exactly one span: put the pieces back in token order.
    merged = torch.cat(outputs, 1).index_select(1, plan.order)  # [H, B·T, D]
    # [H, B·T, D] → [B, T, H, D], the layout HF attention functions return.
    return merged.reshape(h, b, t, d).permute(1, 2, 0, 3).contiguous()


def _dense(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float | None,
           gqa: bool) -> torch.Tensor:
    """One SDPA call over whole rows with the block-diagonal mask; [B, T, H, D] as HF attention returns. GQA's
    key/value heads are repeated first, as transformers' sdpa does with a mask: CUDA's memory-efficient kernel, the
    one that takes a mask, has no native GQA in every torch, and the fallback materialises every score."""
    if gqa:
        key, value = (x.repeat_interleave(query.shape[1] // x.shape[1], dim=1) for x in (key, value))
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous()


def _lengths(cu: torch.Tensor) -> tuple[int, ...]:
    """The span lengths of the varlen offsets. They stay on the CPU: no device sync (and no tensor op: a dry run's
    fake step reads them too)."""
    bounds = cu.tolist()
    return tuple(end - start for start, end in zip(bounds, bounds[1:], strict=False))


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int | None, float | None], torch.Tensor]
"""(query, key, value [B, H, T, D], the layer's sliding window, scaling) → [B, T, H, D], as HF attention returns."""

_REPLACED: list[Attend] = []


@contextlib.contextmanager
def attention_replaced(attend: Attend) -> Iterator[None]:
    """Every `document_sdpa` call inside runs `attend` instead (its forward and backward both run in here): how a
    parallel layout that splits a row's tokens over ranks (`shardline.parallel.context`) brings its own attention,
    so the model's attention function knows no parallelism."""
    _REPLACED.append(attend)
    try:
        yield
    finally:
        _REPLACED.pop()


def document_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention function: per-document causal SDPA when spans are given, else `sdpa` unchanged; scores
    capped as Gemma 2 caps them (`softcap`) on both paths; attention sinks refused by name."""
    cu = offsets.cu_seqlens if (offsets := kwargs.get(HOST_OFFSETS)) is not None else kwargs.get("cu_seq_lens_q")
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if _REPLACED:  # a parallel layout's own attention (context parallel: this rank's queries over the whole row)
        return _REPLACED[-1](query, key, value, int(window) if window else None, scaling), None
    if softcap is not None and (cu is None or query.shape[2] == 1):  # generation, padded evaluation
        if attention_mask is None:  # sdpa's mask function left it to `is_causal`
            keep = _causal_keep(query.shape[2], key.shape[2], window, query.device)
        else:
            keep = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        out = _capped_attention(query, key, value, keep, scaling, float(softcap))
        return out.transpose(1, 2).contiguous(), None
    if cu is None or query.shape[2] == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("s_aux") is not None:
        raise SpecError("model.attn_implementation", f"{type(module).__name__} adds attention sinks, which "
                        "per-document attention does not compute", "set model.attn_implementation=eager (or "
                        "flash_attention_2 on a GPU) for this model")
    if dropout > 0.0:  # attention dropout: one call over whole rows with the block-diagonal mask, as transformers
        # would build it from the positions (`mask_placeholder` kept it from doing so)
        mask = _block_mask(_lengths(cu), query.shape[0], query.shape[2], query.device, int(window) if window else None)
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    gqa = key.shape[1] != query.shape[1]
    if softcap is None and kwargs.get(WHOLE_ROWS) and not (window and window < query.shape[2]):
        with sdpa_kernel(backends) if (backends := sdpa_backends(query.shape[2], query.device)) else nullcontext():
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    if softcap is None and (masks := kwargs.get(DENSE_MASKS)) is not None:  # built before the forward
        return _dense(query, key, value, masks[int(window) if window else 0], scaling, gqa), None
    lengths = _lengths(cu)
    if softcap is None and uses_dense_mask(query.shape[2], query.device):
        mask = _block_mask(lengths, query.shape[0], query.shape[2], query.device,
                           int(window) if window else None)
        if mask is not None:
            return _dense(query, key, value, mask, scaling, gqa), None
    if softcap is None and uses_varlen(query):  # long rows on a GPU: one flash call over every document
        return _varlen(query, key, value, lengths, scaling, gqa, int(window) if window else None), None
    # Mistral, Qwen2, Gemma's local layers: the window is honoured, never dropped; Gemma 2's soft-capping too
    return _per_document(query, key, value, lengths, scaling, gqa, int(window) if window else None,
                         float(softcap) if softcap else None), None


def register() -> None:
    """Make `NAME` known to transformers (idempotent); its masks, when one is needed, are sdpa's."""
    AttentionInterface.register(NAME, document_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
