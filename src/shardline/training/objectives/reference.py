"""The reference policy DPO and GRPO measure the trained policy against: the starting weights, as the LoRA
model with its adapters off, as a frozen sharded copy (a full fine-tune's GRPO KL), or as DPO's table of
log-probabilities precomputed at step 0 and kept in every checkpoint."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import torch
from torch import nn
from torch.profiler import record_function

from shardline.training.objectives.base import Run
from shardline.training.preference import ReferenceTable, adapters_off

Kind = Literal["adapters_off", "frozen_copy", "precomputed"]


class ReferencePolicy:
    """One of the three references; `forward` gives the model to run it (no gradient), `tables` DPO's."""

    def __init__(self, run: Run, kind: Kind) -> None:
        self.run, self.kind = run, kind
        self.frozen: nn.Module | None = run.frozen_copy() if kind == "frozen_copy" else None
        self.tables = ({split: ReferenceTable(run.data.rows(split), run.ctx.device)
                        for split in ("train", "validation")} if kind == "precomputed" else {})

    @contextlib.contextmanager
    def forward(self) -> Iterator[nn.Module]:
        """The model that computes the reference, in the contexts it runs in: no gradient, adapters off."""
        if self.kind == "precomputed":
            raise ValueError("a precomputed reference is looked up in its tables, not run")
        with torch.no_grad(), record_function("shardline.reference"):
            if self.frozen is not None:
                yield self.frozen
            else:
                with adapters_off(self.run.model):
                    yield self.run.model

    def held_bytes(self) -> int:
        """Bytes this rank holds of a frozen copy's weights (0 for the other kinds)."""
        if self.frozen is None:
            return 0
        return sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in self.frozen.parameters())
