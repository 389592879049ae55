"""Memory per TPU chip of a MaxText run (train.engine maxtext): the same accounting as planning/memory.py, for
MaxText's layout instead of FSDP2's.

MaxText shards weights, gradients and optimizer state over every FSDP and tensor-parallel chip of the mesh
(ici_fsdp × ici_tensor inside a slice, × dcn_fsdp when FSDP also spans slices; data parallelism across slices
replicates them). With weight_dtype float32 (what engines/tpu/maxtext.py emits): parameters 4P/S, gradients 4P/S,
AdamW's two moments 8P/S. Layers are scanned: one layer's weights are all-gathered in the compute dtype at a time
(×2 for the prefetched next). Activations per chip: N = per_device_batch_size × max_target_length tokens; remat
`full` keeps each layer's input (c·N·d, split over tensor parallelism) and recomputes one layer at a time; the other
policies are counted as shardline's own `none`/`selective` (planning/memory.block_saved_bytes), an approximation of
MaxText's `minimal` / `save_dot_except_mlp`. Logits and cross-entropy 12·N·V, the vocabulary split over tensor
parallelism. XLA_RUNTIME_BYTES stands for libtpu's reserved buffers and XLA's scratch: an assumption, not measured
(no TPU here).
"""

from __future__ import annotations

from shardline.hardware import tpu_slice
from shardline.planning.devices import Device, GiB
from shardline.planning.memory import MemoryPlan, block_saved_bytes, model_shape, param_budget, selective_saved_bytes
from shardline.spec import JobSpec

XLA_RUNTIME_BYTES = 1 * GiB


def tpu_device(spec: JobSpec) -> Device:
    acc = tpu_slice(spec.launch.tpu.type, spec.launch.tpu.topology).accelerator
    return Device(acc.name, acc.memory_bytes, "tpu")


def state_shards(spec: JobSpec) -> int:
    """Chips each weight is split across: a slice's chips, times the slices when FSDP spans them (dp_replicate 1)."""
    tp = spec.launch.tpu
    chips = tpu_slice(tp.type, tp.topology).chips
    return chips * (tp.slices if spec.parallel.dp_replicate == 1 else 1)


def plan_tpu_memory(spec: JobSpec) -> MemoryPlan:
    shape = model_shape(spec.model)
    pb = param_budget(shape, spec.model.lora)
    t, tp = spec.train, spec.launch.tpu.tensor_parallelism
    s = state_shards(spec)
    c = 4 if t.precision == "fp32" else 2  # auto is bf16 on a TPU
    n = t.micro_batch_size * t.seq_len
    attn = spec.model.attn_implementation
    recompute_layer = block_saved_bytes(shape, c, spec.model.lora, attn, t.seq_len, "tpu") * n / tp
    policy = spec.parallel.activation_checkpointing
    if policy == "full":
        saved = shape.layers * c * n * shape.hidden / tp + recompute_layer
    elif policy == "selective":
        saved = shape.layers * selective_saved_bytes(shape, c, spec.model.lora) * n / tp + recompute_layer
    else:
        saved = shape.layers * recompute_layer
    grads_accum = 4 * pb.trainable / s if spec.grad_accum_steps > 1 else 0
    dev = tpu_device(spec)
    return MemoryPlan(
        params=int(4 * pb.total / s), grads=int(4 * pb.trainable / s), optimizer=int(8 * pb.trainable / s),
        gather_buffers=int(c * 2 * pb.block / tp), activations=int(saved), logits=int(12 * n * shape.vocab / tp),
        temporaries=int(grads_accum), allocator=0, runtime=XLA_RUNTIME_BYTES, phase="start of backward", device=dev,
        capacity_bytes=dev.memory_bytes, host_offload_bytes=0, total_params=pb.total, trainable_params=pb.trainable,
        dp_shard=s, saved_activations=int(saved), family=shape.family)
