"""Seconds per optimizer step before a run: model FLOPs at `cost.assumed_mfu` of the device's peak, the forward that
activation checkpointing runs again, and a QLoRA base's NF4 dequantization (memory-bound, at the device's bandwidth).

- model FLOPs: `shardline.model.flops.flops_per_token` over global batch × seq len tokens (full rows), plus the
  reference's forward where DPO or GRPO's KL runs one; a mixture of experts by its active parameters (top-k of E
  routed experts: `planned_counts`);
- recompute: full AC on every k-th block runs the forward of 1/k of the blocks once more (2 FLOPs per weight of a
  block and 4·a·T of attention per token), at the same MFU; selective AC recomputes no matmul;
- float8 (`train.float8`): the block linears torchao converts (`memory.float8_block_linears`) run their three
  matmuls (forward, input and weight gradients: 6 FLOPs per weight and token, 2 more where recomputed) at the
  device's FP8 peak, where the catalogue has one; everything else at the bf16 peak, at the same MFU;
- dequantization: every NF4 weight is dequantized for each forward and backward of each micro-batch (and for the
  recomputed forward): torchao writes and reads (8 + 3c) bytes of temporaries per element
  (`memory.nf4_dequantize_bytes`) besides reading the NF4 storage — counted at the catalogue's memory bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardline.model.flops import ParamCounts
    from shardline.spec import JobSpec


@dataclass(frozen=True)
class StepTime:
    """One optimizer step's seconds on one device, by what takes them."""

    compute_s: float
    recompute_s: float = 0.0
    dequantize_s: float = 0.0
    float8_tflops: float | None = None
    """The FP8 peak the float8 matmuls were counted at (None: none counted at it)."""

    @property
    def seconds(self) -> float:
        return self.compute_s + self.recompute_s + self.dequantize_s

    def describe(self) -> str:
        """The parts beyond the model FLOPs, for `plan`'s time line ('' when there are none)."""
        parts = [f"{label} {s:.3g} s" for label, s in (("recompute", self.recompute_s),
                                                          ("NF4 dequantization", self.dequantize_s)) if s]
        if self.float8_tflops:
            parts.append(f"the float8 block matmuls at the FP8 peak, {self.float8_tflops:g} TFLOP/s")
        return f" (incl. {', '.join(parts)})" if parts else ""


def recompute_fraction(spec: JobSpec) -> float:
    """Share of the blocks whose forward runs twice: full checkpointing of every k-th block."""
    p = spec.parallel
    return 1.0 / p.activation_checkpointing_every if p.activation_checkpointing == "full" else 0.0


def planned_counts(spec: JobSpec) -> ParamCounts:
    """The model's parameters as `shardline.model.flops` counts them in training (matmul weights trainable and
    frozen, the embedding table, a mixture's routed experts and the share of them a token runs through), from the
    planner's shape: what the trainer's MFU will be computed from."""
    from shardline.model.families import EXPERTS_TARGET
    from shardline.model.flops import ParamCounts
    from shardline.planning.memory import lora_targets, model_shape, param_budget
    from shardline.planning.moe import expert_adapter_params, expert_params

    shape = model_shape(spec.model)
    pb = param_budget(shape, spec.model.lora)
    embedding = shape.vocab * shape.hidden
    matmul = pb.total - embedding + (embedding if shape.tie else 0)  # lm_head counts even when tied
    trainable = pb.trainable if spec.model.lora.enabled else matmul
    experts = pb.layers * expert_params(shape)
    lora = spec.model.lora
    adapters = pb.layers * expert_adapter_params(shape, lora.r) if EXPERTS_TARGET in lora_targets(shape, lora) else 0
    return ParamCounts(trainable=trainable, frozen=matmul - trainable, embedding=embedding, tied=shape.tie,
                       experts_trainable=adapters if lora.enabled else experts,
                       experts_frozen=experts if lora.enabled else 0,
                       active_experts=shape.moe.active_fraction if shape.moe else 1.0)


def step_time(spec: JobSpec, peak_tflops: float, memory_gbps: float | None = None, compute_bytes: int = 2,
              fp8_tflops: float | None = None) -> StepTime:
    """Seconds per step at `cost.assumed_mfu` of `peak_tflops` per device; `memory_gbps` (the device's memory
    bandwidth, GB/s) prices a QLoRA base's dequantization into `compute_bytes` per element (left out where the
    bandwidth is unknown); `fp8_tflops` (the device's FP8 peak) the float8 matmuls of `train.float8`."""
    from shardline.model.flops import flops_per_token
    from shardline.model.nf4_layout import nf4_bytes
    from shardline.planning.memory import (
        float8_block_linears,
        model_shape,
        nf4_block_weights,
        nf4_dequantize_bytes,
        param_budget,
    )
    from shardline.spec.objective import reference_forward

    shape = model_shape(spec.model)
    pb = param_budget(shape, spec.model.lora)
    counts = planned_counts(spec)
    active = counts.active_trainable + counts.active_frozen
    width, t = shape.heads * shape.hd, spec.train
    per_token = flops_per_token(counts, shape.layers, width, t.seq_len, shape.windows)
    if reference_forward(spec):  # DPO's adapters-off reference, GRPO's KL: one more forward of every active matmul
        per_token += 2 * active
    tokens = t.global_batch_size * t.seq_len
    rate = spec.world_size * peak_tflops * 1e12 * spec.cost.assumed_mfu
    fraction = recompute_fraction(spec)
    experts = counts.experts_trainable + counts.experts_frozen
    active_block = pb.block - (1.0 - counts.active_experts) * experts / pb.layers
    recompute = fraction * (2.0 * pb.layers * active_block + 4.0 * shape.layers * width * t.seq_len)
    dequantize = 0.0
    weights = nf4_block_weights(shape, spec.model.lora)
    if weights and memory_gbps:
        c = compute_bytes  # the temporaries written once and read once, the NF4 storage read; whole on every rank
        per_pass = pb.layers * sum(nf4_bytes(n, c) + 2 * nf4_dequantize_bytes(n, c) for n in weights)
        micro_batches = t.global_batch_size // (spec.world_size // spec.parallel.ranks_per_row * t.micro_batch_size)
        dequantize = (2 + fraction) * micro_batches * per_pass / (memory_gbps * 1e9)
    compute_s, recompute_s = per_token * tokens / rate, recompute * tokens / rate
    float8 = shape.layers * sum(i * o for i, o in float8_block_linears(shape, t.float8))
    if float8 and fp8_tflops:  # those matmuls' FLOPs move from the bf16 rate to the FP8 one
        faster = 1.0 - peak_tflops / fp8_tflops
        compute_s -= 6.0 * float8 * tokens / rate * faster
        recompute_s -= fraction * 2.0 * float8 * tokens / rate * faster
        return StepTime(compute_s, recompute_s, dequantize, fp8_tflops)
    return StepTime(compute_s, recompute_s, dequantize)
