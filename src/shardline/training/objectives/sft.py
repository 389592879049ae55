"""Supervised fine-tuning (`train.objective: sft`, also pre-training on raw text): next-token cross-entropy over
the loss-bearing tokens of the step's packed rows; each micro-batch's share is its token-loss sum over the global
count of loss-bearing tokens (all-reduced before the first backward)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.profiler import record_function

from shardline.data.loader import Batch, StepSampler, eval_batches, make_batch, select_rows
from shardline.training.evaluate import validation_loss, validation_loss_sums
from shardline.training.loss import rank_part, token_loss_sum
from shardline.training.metrics import loss_trend
from shardline.training.objectives.base import Run, Share, StepBatches, Validation


class Sft:
    """Next-token loss of the step's training rows; validation loss over the validation rows (per source too)."""

    steps_per_sampling = 1
    sampling_field = None
    validates_first = False
    supports_context_parallel = True

    def __init__(self, run: Run) -> None:
        self.run = run
        t = run.spec.train
        self.rows = run.data.rows("train")
        self.sampler = StepSampler(len(self.rows.n_real), t.seed, t.global_batch_size, t.micro_batch_size,
                                   run.dp_world)
        self.per_token: torch.Tensor | None = None

    def prepare(self) -> None:
        return None

    def start(self, step: int) -> None:
        return None

    def describe(self) -> list[str]:
        return []

    def state(self) -> dict[str, Any]:
        return {}

    def sample(self, step: int) -> float:
        return 0.0

    def step_batches(self, step: int) -> StepBatches:
        """The sampler's micro-batches of step `step` + 1 for this data-parallel rank."""
        indices = [self.sampler.micro_indices(step, k, self.run.dp_rank) for k in range(self.sampler.accum)]
        return StepBatches([make_batch(self.rows, index).to(self.run.ctx.device) for index in indices], indices)

    def begin_step(self, loss_tokens: torch.Tensor) -> None:
        self.per_token = loss_tokens.reciprocal()  # × a token-loss sum: its share (the old (1 / n) × FSDP ranks)

    @contextlib.contextmanager
    def micro_batch(self, k: int, batch: Batch) -> Iterator[Share]:
        with rank_part(self.run.model, batch, self.run.cp_mesh) as part:  # forward and backward in its contexts
            with record_function("shardline.forward"):
                loss = token_loss_sum(self.run.model, part, self.run.spec.train.loss_chunk_tokens)
            yield Share(loss * self.per_token, loss.detach().double() * self.per_token)

    def end_step(self) -> dict[str, Any]:
        return {}

    def validate(self) -> Validation:
        return token_validation(self.run)

    def trend(self, first: Any, last: Any) -> str:
        return loss_trend(first.loss, last.loss)


def token_validation(run: Run) -> Validation:
    """Next-token loss over every validation row (and per source, for a mixture: the whole is their token-weighted
    mean), each rank its share of the rows."""
    rows = run.data.rows("validation")
    names = run.data.meta.get("sources") or []
    t, device = run.spec.train, run.ctx.device
    by_source: dict[str, float] = {}
    if len(names) > 1:
        sums = []
        for i, name in enumerate(names):
            part = select_rows(rows, np.flatnonzero(run.data.row_sources("validation") == i))
            batches = eval_batches(part, t.micro_batch_size, run.dp_rank, run.dp_world)
            total, tokens = validation_loss_sums(run.model, batches, device, t.loss_chunk_tokens, run.cp_mesh,
                                                 run.after_validation_batch)
            by_source[name] = total / max(tokens, 1)
            sums.append((total, tokens))
        loss = sum(s for s, _ in sums) / max(sum(n for _, n in sums), 1)
    else:
        batches = eval_batches(rows, t.micro_batch_size, run.dp_rank, run.dp_world)
        loss = validation_loss(run.model, batches, device, t.loss_chunk_tokens, run.cp_mesh, run.after_validation_batch)
    per = " · ".join(f"{name} {value:.4f}" for name, value in by_source.items())
    return Validation(loss, {"val_loss_by_source": by_source} if by_source else {},
                      f"validation loss {loss:.4f}" + (f" ({per})" if per else ""))


OBJECTIVE = Sft
