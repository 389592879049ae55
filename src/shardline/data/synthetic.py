"""Random-token rows for throughput benchmarks (`data.task: random_tokens`).

The protocol peers publish their numbers with (NeMo AutoModel's and torchtitan's benchmarks): every row one
document of exactly `train.seq_len` uniformly random token ids, every token a target. Nothing is read or
tokenized; the rows are drawn from `data.seed` and written in the prepared layout the loader reads, so the run
trains, checkpoints and resumes exactly like any other. `data.train_size` and `data.validation_size` count rows.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from shardline.data.assemble import ARRAYS, PACKED_SPLITS
from shardline.data.packing import Document, pack
from shardline.spec import JobSpec

RANDOM_TOKENS = "random_tokens"
DEFAULT_TRAIN_ROWS = 4000
"""Training rows when `data.train_size` is unset (None: "all of the data", which random rows do not have)."""


def fingerprint(spec: JobSpec) -> str:
    """What decides the rows: the seed and the row counts (the tokenizer and seq len enter the version apart)."""
    d = spec.data
    return hashlib.sha256(json.dumps([RANDOM_TOKENS, d.seed, rows_of(spec, "train"),
                                      rows_of(spec, "validation")]).encode()).hexdigest()


def rows_of(spec: JobSpec, split: str) -> int:
    if split == "validation":
        return spec.data.validation_size
    return DEFAULT_TRAIN_ROWS if spec.data.train_size is None else spec.data.train_size


def write_random_rows(spec: JobSpec, vocab: int, pad: int, out: Path) -> dict:
    """Both packed splits' arrays under `out`, one document of `seq_len` random ids per row; their stats."""
    seq_len = spec.train.seq_len
    rng = np.random.default_rng(spec.data.seed)
    stats: dict = {"rows_read": 0, "format": RANDOM_TOKENS, "splits": {}, "dropped": {}}
    tokens: dict[str, int] = {}
    for split in PACKED_SPLITS:
        n = rows_of(spec, split)
        ids = rng.integers(0, vocab, size=(n, seq_len), dtype=np.int32)
        rows = pack([Document(ids=row, loss=np.ones(seq_len, dtype=np.uint8)) for row in ids], seq_len, pad,
                    packing=False)
        for name in ARRAYS:
            np.save(out / f"{split}.{name}.npy", getattr(rows, name))
        np.save(out / f"{split}.source.npy", np.zeros(n, dtype=np.int16))
        (out / f"{split}.jsonl").write_bytes(b"")
        real = int(rows.n_real.sum())
        stats["splits"][split] = {"examples": n, "kept": n, "rows": n, "tokens": real,
                                  "loss_tokens": int(rows.loss_mask.sum()), "pad_tokens": n * seq_len - real,
                                  "fill": round(real / max(1, n * seq_len), 4)}
        tokens[split] = real
        stats["rows_read"] += n
    (out / "test.jsonl").write_bytes(b"")
    stats["splits"]["test"] = {"examples": 0, "kept": 0}
    stats["sources"] = [{"name": RANDOM_TOKENS, "weight": 1.0, "format": RANDOM_TOKENS,
                         "rows_read": stats["rows_read"], "dropped": {}, "train_examples": rows_of(spec, "train"),
                         "repeats": 1.0, "tokens": tokens, "loss_tokens": dict(tokens),
                         "share_of_train_tokens": 1.0}]
    return stats
