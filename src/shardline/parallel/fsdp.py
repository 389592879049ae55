"""Apply parallelism to a plain model, in torchtitan's fixed order: float8 linears (`train.float8`) → tensor parallel
(`parallel.tp`) → activation checkpointing → per-block torch.compile → FSDP2 / HSDP (`fully_shard` per block, then the
root).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from shardline.errors import ShardlineError, SpecError
from shardline.model.build import causal_lm, decoder_layers
from shardline.model.float8 import convert_blocks_to_float8
from shardline.model.nf4 import is_nf4, nf4_parameters
from shardline.parallel.expert import apply_expert_parallel, expert_data_parallel_mesh, expert_mesh
from shardline.parallel.tensor import apply_tensor_parallel
from shardline.spec import Float8Recipe, ParallelSpec, Precision

# Selective activation checkpointing keeps the outputs of these (expensive to recompute) ops and
# recomputes everything else (norms, activations, rotary, residual adds) in backward: every attention kernel SDPA or
# the variable-length path can pick (cuDNN is SDPA's choice for long rows on H100/H200), as torchtitan keeps them,
# and tensor parallel's reduce-scatter (sequence parallel), which would otherwise run again.
SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_mm.default,  # `train.float8`'s matmuls (torchao's Float8Linear), as torchtitan keeps them
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._flash_attention_forward.default,
    torch.ops.aten._efficient_attention_forward.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


def device_mesh(spec: ParallelSpec, world: int, device_type: str) -> DeviceMesh:
    """The job's mesh: `dp_shard` for FSDP, `dp_replicate × dp_shard` for HSDP, then `cp` (context parallel) and
    `tp` (tensor parallel) when above 1; tp innermost, so a tensor-parallel group is consecutive ranks, inside a
    node."""
    shard = spec.dp_shard or world // (spec.dp_replicate * spec.ranks_per_row)
    dims = [("dp_replicate", spec.dp_replicate)] if spec.dp_replicate > 1 else []
    dims += [("dp_shard", shard)] + [(name, n) for name, n in (("cp", spec.cp), ("tp", spec.tp)) if n > 1]
    return init_device_mesh(device_type, tuple(n for _, n in dims), mesh_dim_names=tuple(name for name, _ in dims))


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The dimensions FSDP/HSDP shard and replicate over: all but `tp`, with `cp` folded into the shard dimension
    (context-parallel peers hold different tokens of the same rows: their gradients are summed like data
    parallel's)."""
    names = tuple(n for n in mesh.mesh_dim_names if n != "tp")
    if "cp" in names:
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        names = tuple(n for n in names if n not in ("dp_shard", "cp")) + ("dp_shard_cp",)
    return mesh[names] if names != mesh.mesh_dim_names else mesh


def data_parallel_rank(rank: int, world: int, ranks_per_row: int) -> tuple[int, int]:
    """(this rank's index among the data-parallel ranks, their number). Tensor- and context-parallel peers
    (`ranks_per_row`: the mesh's innermost dimensions) are consecutive ranks: they share one index, and so read
    the same rows."""
    return rank // ranks_per_row, world // ranks_per_row


def frozen_in_compute_dtype(model: nn.Module, precision: Precision) -> None:
    """With bf16, frozen weights (a LoRA base) are held in bf16: no fp32 master copy and no per-step cast, the
    values the forward computed with before (bf16 of the fp32 master). Trainable weights keep fp32 masters (one
    dtype among them, as FSDP2 requires); tied weights stay one parameter; NF4 weights (QLoRA) are already in it."""
    if precision != "bf16":
        return
    replaced: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id → (old, new): old kept alive while mapping
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.requires_grad or param.dtype == torch.bfloat16 or is_nf4(param):
                continue
            if id(param) not in replaced:
                replaced[id(param)] = (param, nn.Parameter(param.detach().to(torch.bfloat16), requires_grad=False))
            module._parameters[name] = replaced[id(param)][1]


def mixed_precision(precision: Precision) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 master weights and fp32 gradient reduction; fp32 is plain."""
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, spec: ParallelSpec) -> None:
    if spec.activation_checkpointing == "none":
        return
    kwargs: dict = {"use_reentrant": False}
    if spec.activation_checkpointing == "selective":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _save_matmuls)
    # HF's own per-block checkpointing keeps parameter names unchanged (checkpoints, export).
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs,
                                              every_n_layers=spec.activation_checkpointing_every)
    elif spec.activation_checkpointing_every == 1:  # transformers before the rename (5.17 on the lent GPU images)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise SpecError("parallel.activation_checkpointing_every", "this transformers checkpoints every block or "
                        "none (it has no activation_checkpointing_enable)",
                        "upgrade transformers, or set parallel.activation_checkpointing_every=1")


def block_wrapping(model: nn.Module) -> dict[str, int]:
    """What `parallelize` did to the decoder blocks, read back from them: how many there are, how many are compiled
    (`nn.Module.compile`), checkpointed, and checkpointed with the selective policy (a `context_fn`)."""
    layers = decoder_layers(model)
    checkpointed = [layer for layer in layers if getattr(layer, "gradient_checkpointing", False)]
    return {"blocks": len(layers),
            "compiled": sum(1 for layer in layers if getattr(layer, "_compiled_call_impl", None) is not None),
            "checkpointed": len(checkpointed),
            "selective": sum(1 for layer in checkpointed
                             if "context_fn" in getattr(layer._gradient_checkpointing_func, "keywords", {}))}


def _offload_policy(spec: ParallelSpec, device_type: str) -> OffloadPolicy:
    """Host-resident params/grads/optimizer state; pinned host memory only where there is a device to copy to."""
    return CPUOffloadPolicy(pin_memory=device_type == "cuda") if spec.offload else OffloadPolicy()


def enable_async_tp(spec: ParallelSpec, device_type: str) -> None:
    """`parallel.async_tp`: inductor's micro-pipelined TP for the compiled blocks (CUDA symmetric memory only)."""
    if not spec.async_tp:
        return
    if device_type != "cuda":
        raise SpecError("parallel.async_tp", f"needs CUDA (symmetric memory), but this run is on {device_type}",
                        "set parallel.async_tp=false off GPUs")
    import torch._inductor.config  # only here: the compiler's configuration

    torch._inductor.config._micro_pipeline_tp = True


def parallelize(model: nn.Module, mesh: DeviceMesh, spec: ParallelSpec, precision: Precision,
                float8: Float8Recipe = "none") -> nn.Module:
    enable_async_tp(spec, mesh.device_type)
    frozen_in_compute_dtype(model, precision)
    convert_blocks_to_float8(model, float8, precision, mesh.device_type)  # `train.float8`: before TP, AC and FSDP
    if spec.tp > 1:  # torchtitan's order: tensor parallel on the plain modules first
        apply_tensor_parallel(model, mesh["tp"])
    apply_activation_checkpointing(model, spec)
    layers = decoder_layers(model)
    if spec.compile:
        for layer in layers:
            # sequence parallel's DTensors fail dynamo's dynamic shapes (torch 2.13: "unhashable type: non-nested
            # SymInt" on a new batch shape): with tp, each shape compiles on its own
            layer.compile(dynamic=False if spec.tp > 1 else None)
    # QLoRA's NF4 weights stay whole on every rank, outside FSDP (shardline.model.nf4 says why)
    shard = partial(fully_shard, mesh=data_parallel_mesh(mesh), mp_policy=mixed_precision(precision),
                    offload_policy=_offload_policy(spec, mesh.device_type),
                    ignored_params=nf4_parameters(model) or None)
    if spec.ep > 1:  # each EP rank's experts sharded by FSDP over efsdp on dim 1 (`shardline.parallel.expert`)
        experts = expert_mesh(mesh, spec.ep)
        shard_experts = partial(shard, mesh=expert_data_parallel_mesh(experts), shard_placement_fn=lambda _: Shard(1))
        for i, module in enumerate(apply_expert_parallel(model, experts["ep"])):
            _shard_named(shard_experts, module, f"the experts of MoE layer {i}",
                         reshard_after_forward=spec.reshard_after_forward)
    for i, layer in enumerate(layers):
        _shard_named(shard, layer, f"model.layers.{i}", reshard_after_forward=spec.reshard_after_forward)
    # The root holds embeddings, final norm and output projection; its params are used last in
    # forward and first in backward, so resharding it after forward would only add an all-gather.
    # With LoRA the root is the causal LM inside the peft wrapper, not the wrapper: peft's `generate` calls
    # the inner model's `generate`, which never enters the wrapper's forward, so FSDP hooks on the wrapper
    # would leave the embedding sharded during generation. Parameter names are unchanged either way.
    _shard_named(shard, causal_lm(model), "the root (embeddings, final norm, lm_head)", reshard_after_forward=False)
    return model


def _shard_named(shard, module: nn.Module, name: str, reshard_after_forward: bool) -> None:
    """`fully_shard`, its refusals named by the module (mixed dtypes, parameters FSDP cannot place)."""
    try:
        shard(module, reshard_after_forward=reshard_after_forward)
    except (ValueError, AssertionError, NotImplementedError, RuntimeError) as e:
        raise ShardlineError(f"parallel (fully_shard of {name})", f"FSDP2 cannot shard {type(module).__name__}: "
                             f"{str(e)[:300]}", "give every parameter of the block one dtype and device, or "
                             "keep the module out of parallel.* sharding (report it: shardline wraps every "
                             "decoder block)") from e


def fsdp_param_groups(model: nn.Module) -> list[tuple[str, object]]:
    """(name, FSDPParamGroup) of every sharded module holding parameters: the blocks in order, the root last."""
    root = causal_lm(model)
    groups = [(name, m._get_fsdp_state()._fsdp_param_group) for name, m in root.named_modules()
              if isinstance(m, FSDPModule) and m is not root]
    groups.append(("root", root._get_fsdp_state()._fsdp_param_group))
    return [(name, g) for name, g in groups if g is not None]
