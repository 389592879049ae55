"""What GRPO's sampling costs per step (`train.objective: grpo`): the KV cache it holds and the time it takes.

Each rank samples `global_batch_size / world` sequences of up to `seq_len` tokens (a prompt of at most
`seq_len − max_new_tokens`, then `max_new_tokens` decoded one at a time), `oversample` times when oversampled. A
decode step reads every weight once (FSDP gathers them for each forward) and does 2 FLOPs per parameter per
sequence, so it takes at least the longer of the weights over the memory bandwidth and those FLOPs at
`cost.assumed_mfu` of the peak; the prompts' prefill is compute-bound. This is a lower bound: kernel launches, the
gathers' network time and the sampling's own work add to it, and on a CPU (no bandwidth in the catalogue) only the
FLOPs are counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardline.hardware import Accelerator
from shardline.planning.memory import kv_cache_bytes, model_shape, param_budget
from shardline.spec import JobSpec


@dataclass(frozen=True)
class RolloutEstimate:
    sequences: int
    """Sequences each rank samples per `generate` call (`oversample` calls per sampling)."""
    kv_cache_bytes: int
    """Per rank, at the longest (every sequence at `seq_len` tokens)."""
    seconds: float
    """Sampling seconds per step (a lower bound; one sampling, of `oversample` calls, serves
    `train.grpo.num_iterations` steps)."""
    bound: str
    """What bounds a decode step: `memory` or `compute`."""


def rollout_estimate(spec: JobSpec, peak_tflops: float, device: Accelerator | None) -> RolloutEstimate:
    t, g = spec.train, spec.train.grpo
    shape = model_shape(spec.model)
    params = param_budget(shape, spec.model.lora).total
    weight_bytes = 0.5 if spec.model.lora.quantize_base != "none" else 2 if t.precision != "fp32" else 4
    act_bytes = 4 if t.precision == "fp32" else 2
    sequences = t.global_batch_size // spec.world_size
    kv = kv_cache_bytes(shape, act_bytes, sequences, t.seq_len)
    rate = peak_tflops * 1e12 * spec.cost.assumed_mfu
    compute = 2 * params * sequences / rate
    memory = (params * weight_bytes + kv / 2) / (device.hbm_gbps * 1e9) if device is not None else 0.0
    prefill = 2 * params * sequences * (t.seq_len - g.max_new_tokens) / rate
    decode = max(compute, memory)
    per_sampling = g.oversample * (g.max_new_tokens * decode + prefill)  # one prompt share per generate call
    return RolloutEstimate(sequences, int(kv), per_sampling / g.num_iterations,
                           "memory" if memory > compute else "compute")
