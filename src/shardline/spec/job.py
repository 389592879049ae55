"""`JobSpec`: the sections plus the cross-field rules, checked whenever a spec is built or read."""

from __future__ import annotations

from pydantic import model_validator

from shardline.spec.rules import check_combinations
from shardline.spec.sections import JobSections


class JobSpec(JobSections):
    @model_validator(mode="after")
    def _check_combinations(self) -> JobSpec:
        d = self.data
        if self.train.objective == "dpo" and d.path is None and not d.sources and d.format == "auto":
            d.format = "preference"  # the generated set, drawn as pairs (written out in the resolved spec)
        check_combinations(self)
        return self
