"""Training objectives as plug-ins of the one loop: `train.objective` names one; each implements
`objectives.base.Objective` in a file of its own. Adding an objective is one file and its entry here."""

from __future__ import annotations

from shardline.training.objectives.base import Objective, Run, Share, StepBatches, Validation

__all__ = ["Objective", "Run", "Share", "StepBatches", "Validation", "build"]


def build(run: Run) -> Objective:
    """The objective `run.spec.train.objective` names (imported when chosen)."""
    name = run.spec.train.objective
    if name == "dpo":
        from shardline.training.objectives.dpo import Dpo

        return Dpo(run)
    if name == "grpo":
        from shardline.training.objectives.grpo import Grpo

        return Grpo(run)
    from shardline.training.objectives.sft import Sft

    return Sft(run)
