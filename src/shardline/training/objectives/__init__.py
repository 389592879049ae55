"""Training objectives as plug-ins of the one loop: `train.objective` names one; each implements
`objectives.base.Objective` in a module of that name here, which exports its class as `OBJECTIVE`. Adding an
objective is that one file (and its name in the spec's `Objective` choices, with its settings section if it has
any)."""

from __future__ import annotations

import importlib

from shardline.training.objectives.base import Objective, Run, Share, StepBatches, Validation

__all__ = ["Objective", "Run", "Share", "StepBatches", "Validation", "build"]


def build(run: Run) -> Objective:
    """The objective `run.spec.train.objective` names, imported when chosen (the spec admits only the names of the
    modules here)."""
    return importlib.import_module(f"{__name__}.{run.spec.train.objective}").OBJECTIVE(run)
