"""LoRA adapters via peft: only adapter weights stay trainable; by default on the family's attention projections."""

from __future__ import annotations

from torch import nn

from shardline.errors import SpecError
from shardline.model.families import family_of
from shardline.spec import LoraSpec


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
