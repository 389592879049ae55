"""Prepared splits from tokenized chunks (`shardline.data.encode`): each split's examples file and, for the packed
splits, its rows — packed window by window (best-fit decreasing within `WINDOW` documents) and written as one .npy
per field, block by block, so memory stays bounded by a window whatever the data's size. Validation rows never mix
sources (`<split>.source.npy` says each row's), so its loss can be told per source.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from shardline.data.encode import read_chunk
from shardline.data.packing import Document, pack

ARRAYS = ("tokens", "loss_mask", "position_ids", "n_real")
PACKED_SPLITS = ("train", "validation")


WINDOW = 65_536
"""Documents packed together (best-fit decreasing within a window): the packer's memory, whatever the data's size."""


def write_split(split: str, chunks: list[tuple[int, Path]], seq_len: int, packing: bool, pad: int, out: Path,
                work: Path, per_source: list[dict], dropped: Counter) -> dict:
    """`split.jsonl` from the chunks' examples, and for a packed split its rows, window by window: validation rows
    never mix sources (`split.source.npy` says each row's), so its loss can be told per source."""
    blocks: list[Path] = []
    window: list[Document] = []
    window_source = -1
    examples = too_long = 0

    def flush() -> None:
        if window:
            rows = pack(window, seq_len, pad, packing)
            block = work / "rows" / f"{split}-{len(blocks):06d}.npz"
            block.parent.mkdir(exist_ok=True)
            np.savez(block, source=np.full(len(rows.n_real), window_source, dtype=np.int16),
                     **{a: getattr(rows, a) for a in ARRAYS})
            blocks.append(block)
            window.clear()

    with (out / f"{split}.jsonl").open("wb") as jsonl:
        for source_index, path in chunks:
            z = read_chunk(path)
            text = z[f"{split}.examples"].tobytes()
            jsonl.write(text)
            examples += text.count(b"\n")
            too_long += int(z[f"{split}.too_long"][0])
            ids, loss, lengths = z[f"{split}.ids"], z[f"{split}.loss"], z[f"{split}.lengths"]
            entry = per_source[source_index]
            entry["tokens"][split] = entry["tokens"].get(split, 0) + len(ids)
            entry["loss_tokens"][split] = entry["loss_tokens"].get(split, 0) + int(loss.sum())
            if split not in PACKED_SPLITS:
                continue
            if split == "validation" and source_index != window_source:
                flush()
            window_source = source_index
            joined = z.get(f"{split}.joined", np.zeros(len(lengths), dtype=np.bool_))
            for doc in _documents(ids, loss, lengths, joined):
                window.append(doc)
                if len(window) >= WINDOW:
                    flush()
        flush()
    if too_long:
        dropped[f"{split}:too_long"] += too_long
    split_stats: dict = {"examples": examples, "kept": examples - too_long}
    if split in PACKED_SPLITS and blocks:
        split_stats |= _concatenate(split, blocks, out, seq_len)
    return split_stats


def _documents(ids: np.ndarray, loss: np.ndarray, lengths: np.ndarray, joined: np.ndarray) -> list[Document]:
    """The packing units of a chunk: each document, or documents joined to the next (a preference pair's chosen and
    rejected) as one unit whose positions restart at every document."""
    units, parts = [], []
    ends = np.cumsum(lengths)
    for end, n, glued in zip(ends.tolist(), lengths.tolist(), joined.tolist(), strict=True):
        parts.append((end - n, end))
        if glued:
            continue
        start, stop = parts[0][0], parts[-1][1]
        positions = np.concatenate([np.arange(b - a) for a, b in parts]) if len(parts) > 1 else None
        units.append(Document(ids=ids[start:stop], loss=loss[start:stop], positions=positions))
        parts = []
    return units


def _concatenate(split: str, blocks: list[Path], out: Path, seq_len: int) -> dict:
    """The window blocks' rows as one .npy file per field, appended block by block with plain writes (a writable
    memory map would keep every written page resident until the end)."""
    counts = []
    for block in blocks:
        with np.load(block, allow_pickle=False) as z:
            counts.append(len(z["n_real"]))
    n = sum(counts)
    fields = {"tokens": (np.int32, (n, seq_len)), "loss_mask": (np.uint8, (n, seq_len)),
              "position_ids": (np.int32, (n, seq_len)), "n_real": (np.int32, (n,)), "source": (np.int16, (n,))}
    real = loss_tokens = 0
    for name, (dtype, shape) in fields.items():
        with (out / f"{split}.{name}.npy").open("wb") as f:
            header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
                      "shape": shape}
            np.lib.format.write_array_header_2_0(f, header)
            for block in blocks:
                with np.load(block, allow_pickle=False) as z:
                    values = np.ascontiguousarray(z[name], dtype=dtype)
                f.write(values.tobytes())
                if name == "n_real":
                    real += int(values.sum(dtype=np.int64))
                elif name == "loss_mask":
                    loss_tokens += int(values.sum(dtype=np.int64))
    return {"rows": n, "tokens": real, "loss_tokens": loss_tokens, "pad_tokens": n * seq_len - real,
            "fill": round(real / max(1, n * seq_len), 4)}
