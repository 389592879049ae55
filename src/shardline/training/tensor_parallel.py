"""Tensor parallelism inside a node (`parallel.tp`), with torch's DTensor plans: each decoder block's attention
and MLP projections column-wise then row-wise (Megatron's layout), so a block needs one all-reduce forward and one
backward per sublayer. Embeddings, norms and the output projection stay replicated within the tensor-parallel
group; FSDP2 then shards every parameter (tensor-parallel shards included) over the data-parallel ranks.

Attention keeps working on the local heads: transformers' attention modules reshape with `-1` heads, so a rank
holding 1/tp of the q/k/v columns runs its own heads and kv-heads (the spec rules require tp to divide both).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from shardline.errors import SpecError
from shardline.model.build import causal_lm, decoder_layers
from shardline.model.families import family_of

COLUMNWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
"""QK-norm (Qwen3, Gemma 3): one weight over head_dim, applied to every head. A rank sees only its own heads, so
its weight gradient is a partial sum: the norm's input is marked sharded on the heads dimension ([B, T, H, D]:
dim 2), which makes the gradient of the replicated weight an all-reduce over the tensor-parallel group."""


def check_tensor_parallel(config, tp: int) -> None:
    """Named errors for what this tensor-parallel plan cannot split (checked on the real model config)."""
    if tp == 1:
        return
    family = family_of(config)
    if family.fused:
        raise SpecError("parallel.tp", f"{family.name} fuses q/k/v and gate/up into one projection each, which a "
                        "column-wise split would cut across q, k and v", "set parallel.tp=1 for this family "
                        "(FSDP alone), or use a model with separate projections")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if count % tp:
            raise SpecError("parallel.tp", f"{tp} does not divide the model's {name}={count}: each rank must hold "
                            "whole heads", f"choose a tp that divides {heads} and {kv_heads}")


def _split(layer: nn.Module, name: str, style: type[ColwiseParallel] | type[RowwiseParallel]) -> dict:
    """The plan entries of one projection: the linear itself, or under LoRA (peft's wrapper, `base_layer` inside)
    the frozen base and the adapter factor on the split side: column-wise the base and lora_B (its output
    columns; lora_A sees the whole input, replicated), row-wise the base and lora_A (its input columns, summed
    by the same all-reduce; lora_B then sees a whole, replicated input)."""
    module = layer.get_submodule(name)
    if not hasattr(module, "base_layer"):
        return {name: style()}
    split = "lora_B" if style is ColwiseParallel else "lora_A"
    adapters = {f"{name}.{split}.{adapter}": style() for adapter in getattr(module, split)}
    return {f"{name}.base_layer": style()} | adapters


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split every decoder block's projections over `tp_mesh` (in place; names and module types unchanged)."""
    qk_norm = family_of(causal_lm(model).config).qk_norm
    for i, layer in enumerate(decoder_layers(model)):
        plan: dict = {}
        for names, style in ((COLUMNWISE, ColwiseParallel), (ROWWISE, RowwiseParallel)):
            for name in names:
                try:
                    plan |= _split(layer, name, style)
                except AttributeError as e:
                    raise SpecError("parallel.tp", f"decoder block {i} ({type(layer).__name__}) has no {name}, "
                                    "which the tensor-parallel plan splits", "set parallel.tp=1 for this model") from e
        if qk_norm:
            plan |= {name: SequenceParallel(sequence_dim=2, use_local_output=True) for name in QK_NORMS}
        parallelize_module(layer, tp_mesh, plan)
