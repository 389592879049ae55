"""Deterministic, resumable batches from packed rows.

The training stream is the concatenation of per-epoch permutations of all rows, each seeded by
(`train.seed`, epoch). Global step `s` consumes stream positions `[s·G, (s+1)·G)` (G = global batch
in rows). Within a step, micro-batch `k` of rank `r` takes positions `k·W·M + r·M … + M` (W ranks,
M rows per micro-batch), so ranks see disjoint rows, and a run's data depends only on the step and the
global batch, not on the world size. The cursor is the step: resuming at step `s` continues exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from shardline.data.packing import PackedRows
from shardline.data.spans import DocumentSpans, document_spans

IGNORE_INDEX = -100


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] long
    labels: torch.Tensor  # [B, T] long, next-token targets; IGNORE_INDEX where no loss
    position_ids: torch.Tensor  # [B, T] long
    n_loss_tokens: int
    n_tokens: int  # non-padding tokens
    spans: DocumentSpans | None  # the documents (CPU): document-masked attention and the FLOPs count; None for
    # a rank's context-parallel part (its attention masks come from shardline.parallel.context)

    def to(self, device: torch.device) -> Batch:
        return Batch(self.input_ids.to(device, non_blocking=True), self.labels.to(device, non_blocking=True),
                     self.position_ids.to(device, non_blocking=True), self.n_loss_tokens, self.n_tokens, self.spans)


def make_batch(rows: PackedRows, index: np.ndarray) -> Batch:
    """Gather rows; the label at t is the token at t+1 where that token carries loss."""
    index = np.sort(index)  # sorted reads are kinder to memory maps; order within a batch is irrelevant
    tokens = torch.from_numpy(np.asarray(rows.tokens[index], dtype=np.int64))
    mask = torch.from_numpy(np.asarray(rows.loss_mask[index], dtype=np.bool_))
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[:, :-1] = torch.where(mask[:, 1:], tokens[:, 1:], IGNORE_INDEX)
    positions = torch.from_numpy(np.asarray(rows.position_ids[index], dtype=np.int64))
    n_real = torch.from_numpy(np.asarray(rows.n_real[index], dtype=np.int64))
    spans = document_spans(positions, n_real)
    return Batch(tokens, labels, positions, int(mask[:, 1:].sum()), int(n_real.sum()), spans)


class StepSampler:
    """Maps (step, micro-batch, rank) to row indices of the training stream."""

    def __init__(self, num_rows: int, seed: int, global_rows: int, micro_rows: int, world: int) -> None:
        if num_rows == 0:
            raise ValueError("no training rows")
        self.num_rows, self.seed = num_rows, seed
        self.global_rows, self.micro_rows, self.world = global_rows, micro_rows, world
        self.accum = global_rows // (micro_rows * world)

    @lru_cache(maxsize=4)  # noqa: B019 - a handful of epochs, lives as long as the sampler
    def _epoch(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def _stream(self, start: int, count: int) -> np.ndarray:
        out = np.empty(count, dtype=np.int64)
        for j in range(count):
            epoch, offset = divmod(start + j, self.num_rows)
            out[j] = self._epoch(epoch)[offset]
        return out

    def epoch_of(self, step: int) -> float:
        return step * self.global_rows / self.num_rows

    def micro_indices(self, step: int, micro: int, rank: int) -> np.ndarray:
        start = step * self.global_rows + (micro * self.world + rank) * self.micro_rows
        return self._stream(start, self.micro_rows)

    def step_batches(self, rows: PackedRows, step: int, rank: int) -> list[Batch]:
        return [make_batch(rows, self.micro_indices(step, k, rank)) for k in range(self.accum)]


def select_rows(rows: PackedRows, index: np.ndarray) -> PackedRows:
    """The rows at `index` (in memory): a part of a split, e.g. one source's validation rows."""
    return PackedRows(**{a: np.asarray(getattr(rows, a))[index] for a in ("tokens", "loss_mask", "position_ids",
                                                                          "n_real")})


def eval_batches(rows: PackedRows, batch_rows: int, rank: int, world: int) -> list[Batch]:
    """All rows, split over ranks; every rank gets the same number of batches (FSDP needs lockstep),
    the last ones possibly empty of loss tokens."""
    n = len(rows.n_real)
    per_rank = -(-n // world)
    n_batches = -(-per_rank // batch_rows)
    mine = np.arange(rank * per_rank, min(n, (rank + 1) * per_rank))
    batches = []
    for b in range(n_batches):
        index = mine[b * batch_rows : (b + 1) * batch_rows]
        if len(index) == 0:
            batch = make_batch(rows, np.zeros(1, dtype=np.int64))
            batch.labels.fill_(IGNORE_INDEX)
            batch.n_loss_tokens = batch.n_tokens = 0
        else:
            batch = make_batch(rows, index)
        batches.append(batch)
    return batches
