"""Tensor parallel inside a node (`parallel.tp`), with torch's DTensor plans (torchtitan's layout for Llama):

- each decoder block's attention and MLP projections split column-wise then row-wise (Megatron's layout);
- sequence parallel between them: the residual stream, the norms and the residual adds hold 1/tp of the tokens
  (the row-wise projections reduce-scatter onto the sequence shard; attention and the MLP all-gather it), so
  activation memory outside attention and the MLP falls by tp, for the same bytes on the wire as one all-reduce;
- loss parallel over the vocabulary: an untied output projection is split column-wise and the chunked loss
  (`shardline.training.chunked_loss`) computes each rank's vocabulary columns of the logits only, the
  cross-entropy's reductions done by torch's `loss_parallel`.

Embeddings stay whole within the tensor-parallel group (a tied output projection too: it is the embedding), and
FSDP2 then shards every parameter (tensor-parallel shards included) over the data-parallel ranks. The model's own
forward (rotary tables, masks, Gemma's embedding scale) runs on whole rows: the first block slices its input to the
rank's sequence shard, and the final norm's output is gathered back.

Attention keeps working on the local heads: transformers' attention modules reshape with `-1` heads, so a rank
holding 1/tp of the q/k/v columns runs its own heads and kv-heads (the spec rules require tp to divide both).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from shardline.errors import SpecError
from shardline.model.build import causal_lm, decoder_layers
from shardline.model.families import family_of

COLUMNWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
"""QK-norm (Qwen3, Gemma 3): one weight over head_dim, applied to every head. A rank sees only its own heads, so
its weight gradient is a partial sum: the norm's input is marked sharded on the heads dimension ([B, T, H, D]:
dim 2), which makes the gradient of the replicated weight an all-reduce over the tensor-parallel group."""
SEQUENCE = Shard(1)
"""Hidden states [B, T, d] between the sublayers: split over the tokens."""


class SequenceShards:
    """Whether this forward splits the residual stream over the tokens: only when tp divides its length. A
    generation step (one token) or a padded evaluation batch runs on whole rows: torch's DTensor cannot split one
    token two ways (an empty shard). Set by the first block, read by every sequence-parallel hook of the model."""

    def __init__(self, tp: int) -> None:
        self.tp, self.active = tp, True

    def decide(self, tokens: int) -> None:
        self.active = tokens % self.tp == 0

    @property
    def layout(self) -> tuple:
        return (SEQUENCE,) if self.active else (Replicate(),)


class _SequenceParallel(SequenceParallel):
    """torch's SequenceParallel (weights replicated, input on the sequence shard), on whole rows when inactive."""

    def __init__(self, shards: SequenceShards) -> None:
        super().__init__(use_local_output=True)
        self.shards = shards

    def _prepare_input_fn(self, sequence_sharding, mod, inputs, device_mesh):  # an instance method here
        return SequenceParallel._prepare_input_fn(self.shards.layout, mod, inputs, device_mesh)


class _RowwiseToSequence(RowwiseParallel):
    """torch's RowwiseParallel whose partial sums are reduce-scattered onto the sequence shard (all-reduced onto
    whole rows when inactive)."""

    def __init__(self, shards: SequenceShards) -> None:
        super().__init__()
        self.shards = shards

    def _prepare_output_fn(self, output_layouts, use_local_output, mod, outputs, device_mesh):
        return RowwiseParallel._prepare_output_fn(self.shards.layout, True, mod, outputs, device_mesh)


def _gather(shards: SequenceShards, mesh: DeviceMesh, x, local: bool):
    """The sequence shard → whole rows (all-gather forward, reduce-scatter of the partial gradients backward: the
    column-wise projections take the replicated DTensor as it is). `local`: a plain tensor, for modules that
    cannot take a DTensor (LoRA's replicated factor beside a split base)."""
    if not shards.active:
        return x
    whole = DTensor.from_local(x, mesh, (SEQUENCE,), run_check=False).redistribute(mesh, (Replicate(),))
    return whole.to_local() if local else whole


def _install_sequence_hooks(layers, norm: nn.Module, attention_modules, mesh: DeviceMesh, shards: SequenceShards,
                            local: bool) -> None:
    def enter(module, args, kwargs):  # whole rows, as the model's forward built them → this rank's tokens
        hidden = args[0] if args else kwargs["hidden_states"]
        shards.decide(hidden.shape[1])
        if shards.active:
            hidden = DTensor.from_local(hidden, mesh, (Replicate(),), run_check=False).redistribute(
                mesh, (SEQUENCE,)).to_local()
        return ((hidden, *args[1:]), kwargs) if args else (args, kwargs | {"hidden_states": hidden})

    def gather_kwarg(module, args, kwargs):
        return args, kwargs | {"hidden_states": _gather(shards, mesh, kwargs["hidden_states"], local)}

    def gather_arg(module, args):
        return (_gather(shards, mesh, args[0], local), *args[1:])

    def leave(module, args, output):  # out of the final norm: whole rows for the head and the model's callers
        return _gather(shards, mesh, output, local=True)

    layers[0].register_forward_pre_hook(enter, with_kwargs=True)
    for attention, mlp in attention_modules:
        attention.register_forward_pre_hook(gather_kwarg, with_kwargs=True)
        mlp.register_forward_pre_hook(gather_arg)
    norm.register_forward_hook(leave)


def check_tensor_parallel(config, tp: int) -> None:
    """Named errors for what this tensor-parallel plan cannot split (checked on the real model config)."""
    if tp == 1:
        return
    family = family_of(config)
    if family.experts:
        raise SpecError("parallel.tp", f"{family.name} is a mixture of experts: the tensor-parallel plan splits "
                        "dense MLPs and does not know the fused experts",
                        "set parallel.tp=1 for this model (FSDP shards the experts; parallel.ep splits them over "
                        "ranks)")
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


def _split(layer: nn.Module, name: str, rowwise: bool, shards: SequenceShards) -> dict:
    """The plan entries of one projection: the linear itself, or under LoRA (peft's wrapper, `base_layer` inside)
    the frozen base and the adapter factor on the split side: column-wise the base and lora_B (its output
    columns; lora_A sees the whole input, replicated), row-wise the base and lora_A (its input columns, reduced
    onto the sequence shard as the base is), lora_B then running on the sequence shard with its weight replicated
    (its gradient summed over the group, as the norms' are)."""
    style = _RowwiseToSequence(shards) if rowwise else ColwiseParallel()
    module = layer.get_submodule(name)
    if not hasattr(module, "base_layer"):
        return {name: style}
    split, whole = ("lora_A", "lora_B") if rowwise else ("lora_B", "lora_A")
    plan = {f"{name}.base_layer": style} | {f"{name}.{split}.{a}": style for a in getattr(module, split)}
    if rowwise:
        plan |= {f"{name}.{whole}.{a}": _SequenceParallel(shards) for a in getattr(module, whole)}
    return plan


def _norms(layer: nn.Module) -> list[str]:
    """The block's own norms (pre-attention, pre-MLP, and Gemma's post-sublayer norms): they run on the sequence
    shard."""
    return [name for name, _ in layer.named_children() if name.endswith("norm")]


def _block_plan(layer: nn.Module, index: int, qk_norm: bool, shards: SequenceShards) -> dict:
    plan: dict = {name: _SequenceParallel(shards) for name in _norms(layer)}
    for names, rowwise in ((COLUMNWISE, False), (ROWWISE, True)):
        for name in names:
            try:
                plan |= _split(layer, name, rowwise, shards)
            except AttributeError as e:
                raise SpecError("parallel.tp", f"decoder block {index} ({type(layer).__name__}) has no {name}, "
                                "which the tensor-parallel plan splits", "set parallel.tp=1 for this model") from e
    if qk_norm:
        plan |= {name: SequenceParallel(sequence_dim=2, use_local_output=True) for name in QK_NORMS}
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split every decoder block's projections over `tp_mesh`, sequence-parallel between them, and the untied output
    projection over the vocabulary (in place; names and module types unchanged)."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    _apply_plans(model, tp_mesh)
    # torch's SequenceParallel replaces each weight with a new, trainable Parameter: LoRA's frozen norms stay frozen
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)


def _apply_plans(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    lm = causal_lm(model)
    qk_norm = family_of(lm.config).qk_norm
    layers = decoder_layers(model)
    shards = SequenceShards(tp_mesh.size())
    for i, layer in enumerate(layers):
        parallelize_module(layer, tp_mesh, _block_plan(layer, i, qk_norm, shards))
    parallelize_module(lm.model.norm, tp_mesh, _SequenceParallel(shards))
    lora = any(hasattr(m, "base_layer") for m in model.modules())
    _install_sequence_hooks(layers, lm.model.norm, [(layer.self_attn, layer.mlp) for layer in layers], tp_mesh,
                            shards, local=lora)
    head = lm.get_output_embeddings()
    if head.weight is not lm.get_input_embeddings().weight:
        # whole logits for the model's own forward (generation, an unchunked loss); the chunked loss reads the
        # rank's vocabulary shard of the weight directly (`vocabulary_logits`)
        parallelize_module(head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))


def _split_over_tp(param) -> bool:
    names = getattr(getattr(param, "device_mesh", None), "mesh_dim_names", None) or ()
    return "tp" in names and isinstance(param.placements[names.index("tp")], Shard)


def split_weights(model: nn.Module) -> int:
    """How many parameters are split over the mesh's `tp` dimension (not those it replicates: norms)."""
    return sum(1 for p in model.parameters() if _split_over_tp(p))


def splits_vocabulary(model: nn.Module) -> bool:
    """Whether the output projection's weight is split over the vocabulary (loss parallel)."""
    return _split_over_tp(causal_lm(model).get_output_embeddings().weight)


def loss_context(model: nn.Module) -> AbstractContextManager:
    """torch's `loss_parallel` where the vocabulary is split (the loss's forward and backward run in it)."""
    return loss_parallel() if splits_vocabulary(model) else nullcontext()
