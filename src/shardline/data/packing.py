"""Packing whole examples into fixed-length rows.

Each row holds `seq_len` token ids, a loss mask (1 on the tokens that are targets: answer+EOS, assistant turns,
text) and position ids that restart at 0 at every example boundary. Examples are never split across rows: a split
answer would teach the model to stop (or start) in the wrong place (raw text is cut into pieces of at most
`seq_len` before packing, `shardline.data.prepare`). Rows are filled best-fit-decreasing; the tail is padding
with loss mask 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Document:
    ids: np.ndarray  # int32 token ids: prompt then answer + EOS (or a conversation, or a piece of text)
    n_prompt: int = 0
    """Leading tokens without loss, the rest carrying it; ignored when `loss` is given."""
    loss: np.ndarray | None = None
    """Per token 1 where it is a target (uint8): a conversation's assistant turns, a text's tokens."""
    positions: np.ndarray | None = None
    """Position ids when the document is several packed as one unit (a preference pair: each restarts at 0);
    None: 0, 1, … over the whole."""

    def loss_mask(self) -> np.ndarray:
        if self.loss is not None:
            return np.asarray(self.loss, dtype=np.uint8)
        mask = np.ones(len(self.ids), dtype=np.uint8)
        mask[: self.n_prompt] = 0
        return mask


@dataclass
class PackedRows:
    tokens: np.ndarray  # [rows, seq_len] int32
    loss_mask: np.ndarray  # [rows, seq_len] uint8
    position_ids: np.ndarray  # [rows, seq_len] int32
    n_real: np.ndarray  # [rows] int32: non-padding tokens in each row

    @property
    def pad_tokens(self) -> int:
        return int(self.tokens.size - self.n_real.sum())


def assign_rows(lengths: list[int], seq_len: int, packing: bool) -> list[list[int]]:
    """Document indices per row. Best-fit decreasing: each document goes to the fullest row it fits."""
    if not packing:
        return [[i] for i in range(len(lengths))]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    # rows_by_free[c] holds the rows that have exactly c free slots.
    rows_by_free: list[list[int]] = [[] for _ in range(seq_len + 1)]
    rows: list[list[int]] = []
    for i in order:
        need = lengths[i]
        free = next((c for c in range(need, seq_len + 1) if rows_by_free[c]), None)
        if free is None:
            rows.append([])
            row, free = len(rows) - 1, seq_len
        else:
            row = rows_by_free[free].pop()
        rows[row].append(i)
        rows_by_free[free - need].append(row)
    return rows


def pack(docs: list[Document], seq_len: int, pad_id: int, packing: bool = True) -> PackedRows:
    """Lay documents (each at most `seq_len` tokens) into rows; every token of every document is kept."""
    rows = assign_rows([len(d.ids) for d in docs], seq_len, packing)
    n = len(rows)
    tokens = np.full((n, seq_len), pad_id, dtype=np.int32)
    loss_mask = np.zeros((n, seq_len), dtype=np.uint8)
    position_ids = np.zeros((n, seq_len), dtype=np.int32)
    n_real = np.zeros(n, dtype=np.int32)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            d = docs[i]
            end = at + len(d.ids)
            tokens[r, at:end] = d.ids
            loss_mask[r, at:end] = d.loss_mask()
            position_ids[r, at:end] = d.positions if d.positions is not None else np.arange(len(d.ids))
            at = end
        position_ids[r, at:] = np.arange(seq_len - at)
        n_real[r] = at
    return PackedRows(tokens=tokens, loss_mask=loss_mask, position_ids=position_ids, n_real=n_real)
