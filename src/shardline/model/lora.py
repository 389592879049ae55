"""LoRA adapters via peft: only adapter weights stay trainable; by default on the family's attention projections.

A mixture of experts trains LoRA on attention (and other linear layers outside the MoE block) and, with `experts`
among the targets, on the routed experts' fused projections (`shardline.model.expert_lora`: adapters per expert),
and with `router`, on every MoE layer's router (`shardline.model.router_lora`; frozen without it); adapters on the
MoE block's modules by name (`gate`, the MLP projections, which would reach a shared expert but silently skip the
routed ones), and QLoRA's NF4 base, are named errors."""

from __future__ import annotations

import torch
from torch import nn

from shardline.errors import SpecError
from shardline.model.expert_lora import add_expert_adapters, check_expert_dropout
from shardline.model.families import EXPERTS_TARGET, ROUTER_TARGET, family_of
from shardline.model.moe import is_moe
from shardline.model.nf4 import QuantizedBase, quantize_base_on_meta
from shardline.model.router_lora import add_router_adapters
from shardline.spec import LoraSpec, Precision


def apply_lora(model: nn.Module, spec: LoraSpec) -> nn.Module:
    targets = list(spec.target_modules or family_of(model.config).lora_targets)
    check_expert_targets(model.config, targets)
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()} | ({ROUTER_TARGET} if is_moe(model.config)
                                                                             else set())
    missing = [m for m in targets if m not in names]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise SpecError("model.lora.target_modules", f"{missing} are not modules of this model",
                        f"choose from {linear}")
    experts = EXPERTS_TARGET in targets
    if experts:
        check_expert_dropout(spec.dropout)
    linear = [t for t in targets if t not in (EXPERTS_TARGET, ROUTER_TARGET)]
    if linear:
        from peft import LoraConfig, get_peft_model  # here: ~0.5 s of imports every worker without LoRA skips

        config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                            target_modules=linear, task_type="CAUSAL_LM")
        model = get_peft_model(model, config)
    else:  # the experts alone: no peft layer, the base frozen here
        model.requires_grad_(False)
    if experts:
        add_expert_adapters(model, spec.r, spec.alpha)
    if ROUTER_TARGET in targets:
        add_router_adapters(model.get_base_model() if linear else model, spec.r, spec.alpha)
    return model


EXPERT_TARGETS = ("gate", "gate_up_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
"""Module names of a MoE block (router, expert projections) LoRA does not take: the routed experts are adapted
whole by `experts`, the routers by `router`."""


def check_expert_targets(config, targets: list[str]) -> None:
    """A SpecError for LoRA targets inside a mixture of experts' MoE blocks other than `experts`: peft's modules adapt
    `nn.Linear`s, and the routed experts are fused 3-D parameters (`mlp.experts.gate_up_proj`) it would leave without
    adapters, the routers a weight their own forward reads."""
    refused = [t for t in targets if t in EXPERT_TARGETS]
    if is_moe(config) and refused:
        raise SpecError("model.lora.target_modules", f"{refused} would adapt a mixture of experts' MoE block by "
                        "module name: LoRA on the experts' projections one by one is not supported, and the router "
                        f"is adapted as {ROUTER_TARGET}",
                        f"add {EXPERTS_TARGET} to adapt both projections of every routed expert and {ROUTER_TARGET} "
                        f"to adapt the routers (e.g. [q_proj, k_proj, v_proj, o_proj, {EXPERTS_TARGET}, "
                        f"{ROUTER_TARGET}]), or train the experts with a full fine-tune")


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
