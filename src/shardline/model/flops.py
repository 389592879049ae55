"""Model FLOPs per token, device peaks, and MFU — the formula written once.

Training FLOPs per token (PaLM appendix B; torchtitan `get_dense_model_nparams_and_flops`):

    F = 6·N_trainable + 4·N_frozen + 12·L·d·T

- N counts the weights that take part in matmuls: every parameter except the input embedding table
  (a lookup, no FLOPs); the output projection is counted, also when it is tied to the embedding.
- A trainable weight costs 2 FLOPs per multiply-add forward, 2 for the activation gradient and 2 for
  the weight gradient (6). A frozen weight (LoRA's base) skips the weight gradient but the activation
  gradient still flows through it (4).
- 12·L·d·T is attention's QKᵀ and AV over a context of T tokens, forward + backward, without halving
  for the causal mask (the torchtitan/PaLM convention; MaxText halves it).

MFU = achieved model FLOP/s per device ÷ the device's dense peak for the compute dtype (hardware.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from shardline.hardware import match_device

FORMULA = "6·N_trainable + 4·N_frozen + 12·L·d·T (PaLM/torchtitan, no causal halving)"


@dataclass(frozen=True)
class ParamCounts:
    trainable: int
    frozen: int
    embedding: int
    tied: bool = False
    """The output projection is the embedding matrix (counted in trainable/frozen and in embedding)."""

    @property
    def total(self) -> int:
        """Distinct parameters."""
        return self.trainable + self.frozen + self.embedding - (self.embedding if self.tied else 0)


def count_params(model: nn.Module) -> ParamCounts:
    """Split parameters into trainable and frozen matmul weights and the input embedding table."""
    embed = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is embed
    trainable = frozen = 0
    for p in model.parameters():
        if p is embed:
            continue
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    if tied:  # the tied output projection is a real matmul
        if embed.requires_grad:
            trainable += embed.numel()
        else:
            frozen += embed.numel()
    return ParamCounts(trainable=trainable, frozen=frozen, embedding=embed.numel(), tied=tied)


def flops_per_token(counts: ParamCounts, num_layers: int, hidden: int, seq_len: int) -> float:
    return 6.0 * counts.trainable + 4.0 * counts.frozen + 12.0 * num_layers * hidden * seq_len


def table_peak_tflops(device_name: str, dtype: torch.dtype) -> float | None:
    """The catalogue's dense peak of this GPU for `dtype` (bf16, else tf32/fp32); None when not catalogued."""
    gpu = match_device(device_name)
    if gpu is None:
        return None
    return gpu.bf16_tflops if dtype == torch.bfloat16 else gpu.fp32_tflops


def probe_matmul_tflops(dtype: torch.dtype, device: torch.device, n: int = 1024, seconds: float = 0.5) -> float:
    """Measured dense matmul TFLOP/s for this dtype, device and thread count (CPU peak stand-in)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(3):
        a @ b
    iters, start = 0, time.perf_counter()
    while True:
        a @ b
        iters += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and iters >= 3:
            return 2.0 * n**3 * iters / elapsed / 1e12
