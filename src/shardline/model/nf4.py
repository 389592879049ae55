"""QLoRA's frozen base: the frozen linear weights of a LoRA model as 4-bit NormalFloat (NF4, torchao's NF4Tensor).

Which weights: every `nn.Linear` weight of the decoder blocks that LoRA freezes — the adapted projections' base
weights and every projection LoRA leaves alone. The output head stays in the compute dtype (as in QLoRA: the logits
are the loss's input, and a tied head is the embedding), and so do embeddings, norms and biases.

How: `quantize_base_on_meta` turns those meta parameters into meta NF4 tensors of the compute dtype; `parallelize`
keeps them out of FSDP (`fully_shard(ignored_params=…)`): each rank holds every NF4 weight whole; `materialize`
reads each weight whole (checkpoint or seeded init), in the compute dtype, and quantizes it with torchao's `to_nf4`
on the device — one whole weight at a time, so the block scales and the double quantization of the scales are those
of the whole tensor, the same on every rank and at every world size. NF4 weights are not sharded: torchao's NF4
shards split the inner tensors by element count, which only keeps block and scaler-block boundaries whole when a
weight's block counts divide the world size; replicating them costs (world − 1) × 0.52 bytes per parameter and
keeps the quantization independent of the layout.

torchao's layout (measured, `nf4_bytes`): two 4-bit codes per byte (numel/2), one int8 block scale per
`NF4_BLOCK` = 64 elements, one scaler-block factor in the compute dtype per `NF4_SCALER_BLOCK` = 256 block scales,
and a mean and the 16-entry code book in the compute dtype: 0.5157 bytes per parameter in bf16. torchao needs the
element count to be a multiple of 64 × 256 (`nf4_quantizable`); a weight that is not (SmolLM2's 576 × 576
attention projections) stays in the compute dtype and is named in the log.

Forward and backward run through torchao's `F.linear` override: the weight is dequantized to the compute dtype for
each matmul (forward, and again for the input gradient; it has none of its own).
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from shardline.model.nf4_layout import NF4_BLOCK, NF4_QUANTUM, NF4_SCALER_BLOCK, nf4_quantizable


def _torchao_nf4():
    """torchao's NF4 type and quantizer, imported on first use (its import-time noise: shardline.third_party_noise)."""
    from torchao.quantization import NF4Tensor, to_nf4

    return NF4Tensor, to_nf4


def is_nf4(tensor: torch.Tensor | None) -> bool:
    """Whether `tensor` (a parameter) is an NF4 weight; without importing torchao where nothing loaded it."""
    if tensor is None or "torchao" not in sys.modules:
        return False
    nf4_type, _ = _torchao_nf4()
    return isinstance(tensor, nf4_type)


def to_nf4(weight: torch.Tensor) -> torch.Tensor:
    """torchao's NF4 of a whole weight (its dtype is the dtype it dequantizes to)."""
    _, quantize = _torchao_nf4()
    return quantize(weight.detach().contiguous(), NF4_BLOCK, NF4_SCALER_BLOCK)


@dataclass(frozen=True)
class QuantizedBase:
    """What `quantize_base_on_meta` did: the weights now NF4 and those kept in the compute dtype (numel ∤ 16,384)."""

    quantized: list[str]
    kept: list[str]
    quantized_params: int
    kept_params: int

    def describe(self) -> str:
        kept = Counter(name.replace(".base_layer", "").rsplit(".", 1)[-1] for name in self.kept)
        kept_text = (f"; {self.kept_params / 1e6:.2f}M params kept in the compute dtype, their element count not a "
                     f"multiple of {NF4_QUANTUM} (torchao's 64 × 256 blocks): "
                     + ", ".join(f"{n} ×{k}" for n, k in sorted(kept.items())) if kept else "")
        return (f"QLoRA: {len(self.quantized)} frozen linear weights ({self.quantized_params / 1e6:.2f}M params) "
                f"held as NF4, whole on every rank{kept_text}")


def frozen_linear_weights(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, module) of every frozen `nn.Linear` weight the NF4 base covers: all but the output head's."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    head_weight = head.weight if head is not None else None
    return [(name, m) for name, m in model.named_modules()
            if type(m) is nn.Linear and not m.weight.requires_grad and m.weight is not head_weight
            and ".lora_" not in name]


def quantize_base_on_meta(model: nn.Module, dtype: torch.dtype) -> QuantizedBase:
    """Replace each frozen linear weight of a meta-device LoRA model by a meta NF4 tensor of `dtype` (what
    `materialize` fills and `parallelize` leaves unsharded); weights torchao cannot quantize stay as they are."""
    quantized, kept, n_q, n_k = [], [], 0, 0
    for name, module in frozen_linear_weights(model):
        weight = module.weight
        if weight.device.type != "meta":
            raise ValueError(f"{name}.weight is on {weight.device}: quantize the base before materializing it")
        if not nf4_quantizable(weight.shape):
            kept.append(name)
            n_k += weight.numel()
            continue
        nf4 = to_nf4(torch.empty(weight.shape, dtype=dtype, device="meta"))
        module.weight = nn.Parameter(nf4, requires_grad=False)
        quantized.append(name)
        n_q += weight.numel()
    return QuantizedBase(quantized, kept, n_q, n_k)


def nf4_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The NF4 weights of `model` (FSDP leaves them unsharded)."""
    return {p for p in model.parameters() if is_nf4(p)}


def nf4_stored_bytes(model: nn.Module) -> int:
    """Bytes of every tensor torchao stores for the NF4 weights of `model` (codes, scales, factors, mean, code book)."""
    return sum(getattr(p, name).nbytes for p in nf4_parameters(model) for name in p.__tensor_flatten__()[0])


def dequantize_base(model: nn.Module, dtype: torch.dtype) -> None:
    """Replace every NF4 weight by its dequantized values in `dtype` (a plain frozen parameter): what the run
    computed with, for merging adapters into the base (`shardline export --merge-lora`)."""
    for module in model.modules():
        weight = module._parameters.get("weight")
        if is_nf4(weight):
            module.weight = nn.Parameter(weight.get_original_weight().to(dtype), requires_grad=False)


def reallocate_nf4(model: nn.Module, device: torch.device) -> None:
    """Give every NF4 weight fresh storage on `device` (its values unset: quantized from uninitialised memory), as
    `Module.to_empty` does for plain parameters (it leaves NF4 weights where they were): the dry run's fake step."""
    for module in model.modules():
        for attr, param in list(module._parameters.items()):
            if is_nf4(param):
                dense = torch.empty(param.shape, dtype=param.dtype, device=device)
                module._parameters[attr] = nn.Parameter(to_nf4(dense), requires_grad=False)
