"""Independent checks on prepared data: split packed rows back into documents, and score them one at a time
with a plain transformers model (no packing, no masks of ours)."""

from __future__ import annotations

import numpy as np
import torch

from shardline.data.prepare import PreparedData

IGNORE = -100


def documents_of_rows(data: PreparedData, rows: list[int], split: str = "train") -> list[tuple[int, ...]]:
    """Split packed rows back into documents at their position-id restarts."""
    packed = data.rows(split)
    docs = []
    for r in rows:
        n = int(packed.n_real[r])
        tokens, positions = np.asarray(packed.tokens[r, :n]), np.asarray(packed.position_ids[r, :n])
        starts = [*np.flatnonzero(positions == 0).tolist(), n]
        docs += [tuple(tokens[a:b].tolist()) for a, b in zip(starts, starts[1:], strict=False)]
    return docs


@torch.no_grad()
def unpacked_loss(model, data: PreparedData, split: str = "validation") -> float:
    """A plain transformers model's loss on a prepared split: each packed document alone, token-weighted."""
    rows = data.rows(split)
    total, count = 0.0, 0
    for r in range(len(rows.n_real)):
        n = int(rows.n_real[r])
        starts = [*np.flatnonzero(np.asarray(rows.position_ids[r, :n]) == 0).tolist(), n]
        for a, b in zip(starts, starts[1:], strict=False):
            ids = torch.tensor(np.asarray(rows.tokens[r, a:b], dtype=np.int64))[None]
            mask = torch.tensor(np.asarray(rows.loss_mask[r, a:b], dtype=bool))[None]
            logits = model(input_ids=ids).logits.float()
            total += float(torch.nn.functional.cross_entropy(logits[0, :-1], torch.where(mask, ids, IGNORE)[0, 1:],
                                                             ignore_index=IGNORE, reduction="sum"))
            count += int(mask[0, 1:].sum())
    return total / count
