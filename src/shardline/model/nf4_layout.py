"""torchao's NF4 storage layout, as the planner counts it without importing torch (`shardline.model.nf4` uses it)."""

from __future__ import annotations

import math

NF4_BLOCK = 64
"""Elements per NF4 block (one absmax scale each): torchao's and QLoRA's default."""
NF4_SCALER_BLOCK = 256
"""Block scales per double-quantization block (one scale factor each): torchao's and QLoRA's default."""
NF4_QUANTUM = NF4_BLOCK * NF4_SCALER_BLOCK
"""torchao quantizes a tensor only when its element count is a multiple of this (16,384)."""
NF4_CODES = 16
"""Entries of the NF4 code book stored with every tensor (in the compute dtype)."""


def nf4_quantizable(shape: tuple[int, ...]) -> bool:
    """Whether torchao can quantize a weight of this shape (2-D, element count a multiple of `NF4_QUANTUM`)."""
    return len(shape) == 2 and math.prod(shape) % NF4_QUANTUM == 0


def nf4_bytes(numel: int, dtype_bytes: int) -> int:
    """Storage of one NF4 weight of `numel` elements quantized from a `dtype_bytes`-byte dtype, as torchao lays it
    out: codes (numel/2, uint8), block scales (numel/64, int8), scaler-block factors (numel/16384, compute dtype),
    the scales' mean (one, compute dtype) and the code book (16, compute dtype)."""
    return numel // 2 + numel // NF4_BLOCK + numel // NF4_QUANTUM * dtype_bytes + (1 + NF4_CODES) * dtype_bytes
