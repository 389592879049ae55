"""What a spec's training objective resolves to, for the trainer and the planner alike."""

from __future__ import annotations

from shardline.spec.sections import JobSections


def dpo_reference(spec: JobSections) -> str | None:
    """The reference a DPO run uses (`train.dpo.reference`, `auto` resolved); None without DPO."""
    t = spec.train
    if t.objective != "dpo":
        return None
    if t.dpo.reference == "auto":
        return "adapters_off" if spec.model.lora.enabled else "precomputed"
    return t.dpo.reference


def frozen_reference_copy(spec: JobSections) -> bool:
    """Whether the run holds a frozen copy of the starting weights as its reference: GRPO's KL (`train.grpo.beta`
    > 0) in a full fine-tune, which has no adapters to turn off."""
    return spec.train.objective == "grpo" and spec.train.grpo.beta > 0 and not spec.model.lora.enabled


def reference_forward(spec: JobSections) -> bool:
    """Whether every step runs a reference forward besides the policy's: DPO's adapters-off reference, GRPO's KL."""
    return dpo_reference(spec) == "adapters_off" or (spec.train.objective == "grpo" and spec.train.grpo.beta > 0)
