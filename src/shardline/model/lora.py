"""LoRA adapters via peft: only adapter weights stay trainable; by default on the family's attention projections.

A mixture of experts trains LoRA on attention (and other linear layers outside the MoE block) with the routed
experts and the router frozen; adapters on the fused experts, on the router or on the MLP projections (which would
reach a shared expert but silently skip the routed ones), and QLoRA's NF4 base, are named errors for now."""

from __future__ import annotations

import torch
from torch import nn

from shardline.errors import SpecError
from shardline.model.families import family_of
from shardline.model.moe import is_moe
from shardline.model.nf4 import QuantizedBase, quantize_base_on_meta
from shardline.spec import LoraSpec, Precision


def apply_lora(model: nn.Module, spec: LoraSpec) -> nn.Module:
    targets = list(spec.target_modules or family_of(model.config).lora_targets)
    check_expert_targets(model.config, targets)
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [m for m in targets if m not in names]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise SpecError("model.lora.target_modules", f"{missing} are not modules of this model",
                        f"choose from {linear}")
    from peft import LoraConfig, get_peft_model  # here: ~0.5 s of imports every worker without LoRA skips

    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                        target_modules=targets, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


EXPERT_TARGETS = ("experts", "gate", "gate_up_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
"""Module names of a MoE block (routed experts, router, expert projections) LoRA does not take yet."""


def check_expert_targets(config, targets: list[str]) -> None:
    """A SpecError for LoRA targets inside a mixture of experts' MoE blocks: peft's modules adapt `nn.Linear`s, and
    the routed experts are fused 3-D parameters (`mlp.experts.gate_up_proj`) it would leave without adapters."""
    refused = [t for t in targets if t in EXPERT_TARGETS]
    if is_moe(config) and refused:
        raise SpecError("model.lora.target_modules", f"{refused} would adapt a mixture of experts' MoE block: LoRA "
                        "on the routed experts (fused [E, 2I, H] parameters) and on the router is not supported yet",
                        "target the attention projections (the default: q_proj, k_proj, v_proj, o_proj), or train "
                        "the experts with a full fine-tune")


def quantize_frozen_base(model: nn.Module, spec: LoraSpec, precision: Precision) -> QuantizedBase | None:
    """`model.lora.quantize_base`: with nf4, the frozen linear weights of a meta-device LoRA model become meta NF4
    weights of the compute dtype (`shardline.model.nf4`); None with none."""
    if spec.quantize_base == "none":
        return None
    if is_moe(model.config):
        raise SpecError("model.lora.quantize_base", "nf4 with a mixture of experts is not supported yet (the fused "
                        "expert weights are not linear layers torchao's NF4 quantizes)",
                        "set model.lora.quantize_base=none (LoRA on a bf16 base)")
    return quantize_base_on_meta(model, torch.bfloat16 if precision == "bf16" else torch.float32)
