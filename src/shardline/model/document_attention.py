"""Attention over packed rows that only computes what the document mask keeps.

A packed row holds several documents; each token may only see earlier tokens of its own document.
Hugging Face's `sdpa` path builds that as a dense block-diagonal [T, T] mask, so the kernel computes all
T² query-key pairs and throws most away (rows of 512 tokens holding ~92-token documents keep 1/11 of
them), and CPU SDPA runs far slower with an explicit mask than with `is_causal`.

`document_sdpa` runs SDPA once per document, causal, with no mask: the work is Σ len² instead of T² per
row and the fast causal kernels apply (CPU flash, CUDA flash/cuDNN/efficient). The documents come from
`shardline.data.spans` (a document starts where its position is 0), passed to the model as the same
varlen keywords flash-attention-2 reads (`cu_seq_lens_q`, …), so `flash_attention_2` on GPU takes the
same spans with no work of its own. Without spans (generation, evaluation with padding) the
function is plain `sdpa`, masks and all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "shardline_document_sdpa"
"""The implementation's key in transformers' attention registry; specs say `sdpa`."""


CPU_LENGTH_BUCKET = 32
"""On CPU a document's span is rounded up to a multiple of this: the CPU flash kernels build and keep one
kernel per sequence length (bf16: ~3 MB each, measured), so raw lengths would grow memory with every new
length. The causal mask keeps the extra tokens (the next document's) out of the real queries' view, and
their own outputs are dropped."""


@torch.compiler.disable  # a Python loop over data-dependent spans: compiled blocks run around it
def _per_document(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int],
                  scaling: float | None, gqa: bool) -> torch.Tensor:
    b, h, t, d = query.shape
    bucket = CPU_LENGTH_BUCKET if query.device.type == "cpu" else 1
    # [B, H, T, D] → [H, B·T (+ room to round the last span up), D]: documents are contiguous spans.
    q, k, v = (F.pad(x.transpose(0, 1).reshape(x.shape[1], b * t, d), (0, 0, 0, bucket - 1)) for x in
               (query, key, value))
    outputs, start = [], 0
    for n in lengths:
        span = slice(start, start + -(-n // bucket) * bucket)
        out = F.scaled_dot_product_attention(q[None, :, span], k[None, :, span], v[None, :, span], is_causal=True,
                                             scale=scaling, enable_gqa=gqa)
        outputs.append(out[0, :, :n])
        start += n
    # [H, B·T, D] → [B, T, H, D], the layout HF attention functions return.
    return torch.cat(outputs, 1).reshape(h, b, t, d).permute(1, 2, 0, 3).contiguous()


def document_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention function: per-document causal SDPA when spans are given, else `sdpa` unchanged."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[2] == 1 or dropout > 0.0:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    lengths = (cu[1:] - cu[:-1]).tolist()  # spans stay on the CPU for this path: no device sync
    gqa = key.shape[1] != query.shape[1]
    return _per_document(query, key, value, lengths, scaling, gqa), None


def register() -> None:
    """Make `NAME` known to transformers (idempotent); its masks, when one is needed, are sdpa's."""
    AttentionInterface.register(NAME, document_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
