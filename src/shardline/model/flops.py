"""Model FLOPs, device peaks, and MFU — the formulas written once.

Training FLOPs of a step (PaLM appendix B; torchtitan `get_dense_model_nparams_and_flops`):

    F = (6·N_trainable + 4·N_frozen)·tokens + 12·a·Σ_layers Σ_documents pairs


- N counts the weights that take part in matmuls: every parameter except the input embedding table
  (a lookup, no FLOPs); the output projection is counted, also when it is tied to the embedding.
- A trainable weight costs 2 FLOPs per multiply-add forward, 2 for the activation gradient and 2 for
  the weight gradient (6). A frozen weight (LoRA's base) skips the weight gradient but the activation
  gradient still flows through it (4).
- 12·a·pairs is attention's QKᵀ and AV, forward + backward, with a = heads × head_dim (the attention width:
  the hidden size for Llama, not for Qwen3 or Gemma), over the query-key pairs the document mask keeps: len²
  per document, or the band |i − j| < w of the len × len square on a layer with a sliding window w
  (Mistral, Gemma's local layers).
  Per token that is 12·L·a·T for a context of T tokens (one document filling the row: the planner's
  `flops_per_token`). Packed rows of ~92-token documents in 512-token rows keep 1/5 of the T² pairs;
  counting T² would inflate MFU with work nobody needs.
- A mixture of experts counts the weights a token runs through (active parameters): of the routed experts'
  fused weights only top-k of E, `N_active = N − (1 − k/E)·N_experts` for trainable and frozen alike (the router,
  a shared expert and dense layers count whole); with hardware FLOPs alike, since the experts implementation runs
  each token through its k experts only.
- No halving for the causal mask (the torchtitan/PaLM convention, so numbers compare with theirs);
  MFU with the causal half only is reported beside it (MaxText halves).

MFU = achieved model FLOP/s per device ÷ the device's dense peak for the compute dtype (hardware.py): the
headline. HFU (hardware FLOPs utilisation) counts what the kernels execute instead: padding slots, the
attention pairs the kernel computes (per-document causal kernels: Σ len·(len+1)/2 over all spans; a
dense mask: T² per row) and the forward that activation checkpointing recomputes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from shardline.data.spans import window_pairs
from shardline.hardware import match_device
from shardline.model.moe import active_expert_fraction, expert_parameters

FORMULA = ("(6·N_trainable + 4·N_frozen)·tokens + 12·(heads·head_dim)·Σ layers Σ documents len² (the band "
           "|i − j| < window on sliding-window layers) (PaLM/torchtitan, no causal halving; N: active parameters, "
           "top-k of E routed experts)")


@dataclass(frozen=True)
class ParamCounts:
    trainable: int
    frozen: int
    embedding: int
    tied: bool = False
    """The output projection is the embedding matrix (counted in trainable/frozen and in embedding)."""
    experts_trainable: int = 0
    """Of `trainable`, the routed experts' weights (a mixture of experts)."""
    experts_frozen: int = 0
    active_experts: float = 1.0
    """The share of the routed experts' weights a token runs through: top-k / E."""

    @property
    def total(self) -> int:
        """Distinct parameters."""
        return self.trainable + self.frozen + self.embedding - (self.embedding if self.tied else 0)

    @property
    def active_trainable(self) -> float:
        """Trainable matmul weights one token runs through (all of them in a dense model)."""
        return self.trainable - (1.0 - self.active_experts) * self.experts_trainable

    @property
    def active_frozen(self) -> float:
        return self.frozen - (1.0 - self.active_experts) * self.experts_frozen


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
    experts = expert_parameters(model)
    return ParamCounts(trainable=trainable, frozen=frozen, embedding=embed.numel(), tied=tied,
                       experts_trainable=sum(p.numel() for p in experts if p.requires_grad),
                       experts_frozen=sum(p.numel() for p in experts if not p.requires_grad),
                       active_experts=active_expert_fraction(model.config))


def flops_per_token(counts: ParamCounts, num_layers: int, width: int, seq_len: int,
                    windows: tuple[int | None, ...] = ()) -> float:
    """Per token when every document fills its `seq_len`-token row (the planner's estimate); `width` is the
    attention width (heads × head_dim), `windows` each layer's sliding window (empty: all global)."""
    layers = windows or (None,) * num_layers
    context = sum(window_pairs(seq_len, w) for w in layers) / seq_len
    return 6.0 * counts.active_trainable + 4.0 * counts.active_frozen + 12.0 * width * context


@dataclass(frozen=True)
class StepWork:
    """What one step trained on, summed over the ranks' micro-batches (`shardline.data.spans`)."""

    tokens: int  # real tokens
    slots: int  # rows × seq_len: what the matmuls process, padding included
    pairs: int  # Σ len² over documents
    causal_pairs: int  # Σ len·(len+1)/2 over documents
    executed_pairs: int  # query-key pairs the attention kernel computes
    window_pairs: int = 0  # the same as `pairs` on a sliding-window layer (`FlopsModel.window`)
    window_causal_pairs: int = 0


@dataclass(frozen=True)
class FlopsModel:
    counts: ParamCounts
    num_layers: int
    width: int
    """Attention width, heads × head_dim."""
    recompute_fraction: float = 0.0
    """Share of the decoder blocks whose forward activation checkpointing runs twice."""
    windows: tuple[int | None, ...] = ()
    """Each layer's sliding window (empty: every layer global); the families have one window size."""

    @property
    def window(self) -> int | None:
        return max((w for w in self.windows if w), default=None)

    @property
    def windowed_layers(self) -> int:
        return sum(1 for w in self.windows if w)

    def model(self, work: StepWork, causal: bool = False) -> float:
        """The headline's FLOPs (`causal`: with the causal half of attention only)."""
        dense = 6.0 * self.counts.active_trainable + 4.0 * self.counts.active_frozen
        pairs = work.causal_pairs if causal else work.pairs
        banded = work.window_causal_pairs if causal else work.window_pairs
        global_layers = self.num_layers - self.windowed_layers
        return dense * work.tokens + 12.0 * self.width * (global_layers * pairs + self.windowed_layers * banded)

    def hardware(self, work: StepWork) -> float:
        """FLOPs the kernels execute: padding slots, the attention pairs computed (a windowed per-document
        kernel still computes its whole causal span), recomputed forwards."""
        weights = self.counts.active_trainable + self.counts.active_frozen
        dense = (6.0 * self.counts.active_trainable + 4.0 * self.counts.active_frozen) * work.slots
        attention = 12.0 * self.num_layers * self.width * work.executed_pairs
        recompute = self.recompute_fraction * (2.0 * weights * work.slots
                                               + 4.0 * self.num_layers * self.width * work.executed_pairs)
        return dense + attention + recompute


def table_peak_tflops(device_name: str, dtype: torch.dtype) -> float | None:
    """The catalogue's dense peak of this GPU for `dtype` (bf16, else tf32/fp32); None when not catalogued."""
    gpu = match_device(device_name)
    if gpu is None:
        return None
    return gpu.bf16_tflops if dtype == torch.bfloat16 else gpu.fp32_tflops


def probe_cpu_peak_tflops(dtype: torch.dtype, sizes: tuple[int, ...] = (256, 1024),
                          seconds: float = 0.25) -> tuple[float, str]:
    """The CPU's dense matmul peak for training in `dtype`, measured: the best over a few sizes of `dtype` and of
    fp32. A CPU without bf16 matrix units (AVX2 only) emulates bf16 far below its fp32 rate, and parts of a bf16
    step run in fp32, so a bf16-only probe is no ceiling: MFU above 100 % was the symptom. Returns the peak and
    which dtype set it."""
    cpu = torch.device("cpu")
    best = {torch.float32: max(probe_matmul_tflops(torch.float32, cpu, n=n, seconds=seconds) for n in sizes)}
    if dtype != torch.float32:
        # Smallest size first: an emulated dtype (bf16 at ~2 GFLOP/s on AVX2) would take seconds per large matmul.
        best[dtype] = 0.0
        for n in sorted(sizes):
            best[dtype] = max(best[dtype], probe_matmul_tflops(dtype, cpu, n=n, seconds=seconds))
            if best[dtype] < best[torch.float32] / 4:
                break
    winner = max(best, key=best.__getitem__)
    return best[winner], str(winner).removeprefix("torch.")


def probe_matmul_tflops(dtype: torch.dtype, device: torch.device, n: int = 1024, seconds: float = 0.5) -> float:
    """Measured dense matmul TFLOP/s for this dtype, device and thread count (CPU peak stand-in)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(2):  # warm-up: kernel selection, page faults, library handles
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    iters, start = 0, time.perf_counter()
    while True:
        a @ b
        iters += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and iters >= 3:
            return 2.0 * n**3 * iters / elapsed / 1e12
