"""Direct preference optimisation (`train.objective: dpo`): each packed row holds chosen/rejected pairs; a
micro-batch's share is the sum of its pairs' losses over the global count of pairs (plus `train.dpo.sft_weight` ×
the chosen completions' NLL over the global count of their tokens). The pair maths: `training.preference`."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from shardline.data.loader import Batch, eval_batches
from shardline.spec.objective import dpo_reference
from shardline.training.loss import rank_part
from shardline.training.objectives.base import Run, Share, StepBatches, Validation
from shardline.training.objectives.reference import ReferencePolicy
from shardline.training.objectives.sft import Sft
from shardline.training.preference import (
    METRICS,
    chosen_targets,
    dpo_losses,
    eval_row_indices,
    mean_metrics,
    pair_logps,
    pair_metrics,
    pairs_in,
)


class Dpo(Sft):
    """DPO over the step's pair rows (drawn as SFT draws its rows), against the reference (`train.dpo.reference`)."""

    validates_first = True  # where the preferences start: the report's first point
    supports_context_parallel = False  # a pair's log-probabilities are summed on the rank holding its whole row

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.reference = ReferencePolicy(run, dpo_reference(run.spec))
        self.sums = torch.zeros(len(METRICS), dtype=torch.float64, device=run.ctx.device)

    def start(self, step: int) -> None:
        """`train.dpo.reference: precomputed` at step 0: every pair's reference log-probabilities with the
        starting weights (a resume finds them in its checkpoint)."""
        if not self.reference.tables or step != 0:
            return
        run, started = self.run, time.perf_counter()
        for split, table in self.reference.tables.items():
            table.compute(run.model, run.data.rows(split), run.spec.train.micro_batch_size, run.dp_rank, run.dp_world,
                          run.spec.train.loss_chunk_tokens, run.ctx.device)
        seconds = time.perf_counter() - started
        run.event(event="reference_logps", seconds=round(seconds, 3),
                  documents={split: t.values.numel() for split, t in self.reference.tables.items()})
        pairs = sum(t.values.numel() // 2 for t in self.reference.tables.values())
        run.say(f"DPO reference: log-probabilities of {pairs:,} pairs computed with the starting weights in "
                f"{seconds:.1f}s (kept in every checkpoint)")

    def state(self) -> dict[str, Any]:
        """The precomputed reference (computed once with the starting weights: a resume must not recompute it)."""
        if not self.reference.tables:
            return {}
        return {"reference_logps": {split: t.values for split, t in self.reference.tables.items()}}

    def step_batches(self, step: int) -> StepBatches:
        self.drawn = super().step_batches(step)
        return self.drawn

    def begin_step(self, loss_tokens: torch.Tensor) -> None:
        counts = torch.tensor([float(pairs_in(self.drawn.batches)), float(chosen_targets(self.drawn.batches))],
                              dtype=torch.float64, device=self.run.ctx.device)
        dist.all_reduce(counts)
        self.pairs, self.chosen_tokens = counts.clamp(min=1).unbind()
        self.sums = torch.zeros(len(METRICS), dtype=torch.float64, device=self.run.ctx.device)

    def _reference_logps(self, batch: Batch, index, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference log-probabilities of `batch`'s pairs: the adapters-off forward, or the precomputed table."""
        if self.reference.tables:
            return self.reference.tables[split].lookup(index)
        with self.reference.forward() as model:
            ref = pair_logps(model, batch, self.run.spec.train.loss_chunk_tokens)
        return ref.chosen, ref.rejected

    @contextlib.contextmanager
    def micro_batch(self, k: int, batch: Batch) -> Iterator[Share]:
        t = self.run.spec.train
        ref_chosen, ref_rejected = self._reference_logps(batch, self.drawn.indices[k], "train")
        with rank_part(self.run.model, batch, None):
            with record_function("shardline.forward"):
                policy = pair_logps(self.run.model, batch, t.loss_chunk_tokens)
                losses, chosen, rejected = dpo_losses(policy, ref_chosen, ref_rejected, t.dpo)
                loss = losses.sum() / self.pairs
                value = losses.detach().double().sum() / self.pairs
                if t.dpo.sft_weight:
                    loss = loss - t.dpo.sft_weight * policy.chosen.sum() / self.chosen_tokens
                    value = value - t.dpo.sft_weight * policy.chosen.detach().double().sum() / self.chosen_tokens
            yield Share(loss, value)
        self.sums += pair_metrics(losses, chosen, rejected, policy)

    def end_step(self) -> dict[str, Any]:
        """The global batch's pairs and their means (`training.preference.mean_metrics`)."""
        dist.all_reduce(self.sums)
        return {"preference": mean_metrics(self.sums, self.run.spec.train.dpo.sft_weight)}

    @torch.no_grad()
    def _preference_means(self) -> dict:
        """DPO's loss, rewards and accuracy over every validation pair."""
        run, t = self.run, self.run.spec.train
        rows = run.data.rows("validation")
        sums = torch.zeros(len(METRICS), dtype=torch.float64, device=run.ctx.device)
        indices = eval_row_indices(len(rows.n_real), t.micro_batch_size, run.dp_rank, run.dp_world)
        batches = eval_batches(rows, t.micro_batch_size, run.dp_rank, run.dp_world)
        run.model.eval()
        try:
            for index, batch in zip(indices, batches, strict=True):
                batch = batch.to(run.ctx.device)
                if len(index) == 0 and self.reference.tables:
                    ref = (torch.zeros(0, dtype=torch.float64, device=run.ctx.device),) * 2
                else:
                    ref = self._reference_logps(batch, index, "validation")
                policy = pair_logps(run.model, batch, t.loss_chunk_tokens)
                sums += pair_metrics(*dpo_losses(policy, *ref, t.dpo), policy)
                run.after_validation_batch()
        finally:
            run.model.train()
        dist.all_reduce(sums)
        return mean_metrics(sums, t.dpo.sft_weight)

    def validate(self) -> Validation:
        found = self._preference_means()
        return Validation(found["loss"], {"val_preference": found},
                          f"validation DPO loss {found['loss']:.4f} · reward accuracy {found['accuracy']:.3f} · margin "
                          f"{found['margin']:+.4f} · chosen more likely than rejected in "
                          f"{100 * found['prefers_chosen']:.1f}% of {found['pairs']} pairs")


OBJECTIVE = Dpo
