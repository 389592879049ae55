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
