"""Apply parallelism to a plain model, in torchtitan's fixed order:
activation checkpointing → per-block torch.compile → FSDP2 (`fully_shard` per block, then the root).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from shardline.model.build import decoder_layers
from shardline.spec import ParallelSpec, Precision


def mixed_precision(precision: Precision) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 master weights and fp32 gradient reduction; fp32 is plain."""
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def parallelize(model: nn.Module, mesh: DeviceMesh, spec: ParallelSpec, precision: Precision) -> nn.Module:
    if spec.activation_checkpointing:
        # HF's own per-block checkpointing keeps parameter names unchanged (checkpoints, export).
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    layers = decoder_layers(model)
    if spec.compile:
        for layer in layers:
            layer.compile()
    mp = mixed_precision(precision)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=spec.reshard_after_forward)
    # The root holds embeddings, final norm and output projection; its params are used last in
    # forward and first in backward, so resharding it after forward would only add an all-gather.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return model
