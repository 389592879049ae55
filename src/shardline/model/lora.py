"""LoRA adapters via peft: only adapter weights stay trainable; by default on the family's attention projections."""

from __future__ import annotations

import torch
from torch import nn

from shardline.errors import SpecError
from shardline.model.families import family_of
from shardline.model.nf4 import QuantizedBase, quantize_base_on_meta
from shardline.spec import LoraSpec, Precision


def apply_lora(model: nn.Module, spec: LoraSpec) -> nn.Module:
    targets = list(spec.target_modules or family_of(model.config).lora_targets)
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


def quantize_frozen_base(model: nn.Module, spec: LoraSpec, precision: Precision) -> QuantizedBase | None:
    """`model.lora.quantize_base`: with nf4, the frozen linear weights of a meta-device LoRA model become meta NF4
    weights of the compute dtype (`shardline.model.nf4`); None with none."""
    if spec.quantize_base == "none":
        return None
    return quantize_base_on_meta(model, torch.bfloat16 if precision == "bf16" else torch.float32)
