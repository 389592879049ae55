"""Tokenizing sources into documents, chunk by chunk, on the node's cores, resumable.

A source's examples are cut into chunks of `CHUNK` examples in stream order (fewer where their texts pass
`CHUNK_CHARS` characters: a chunk's memory is bounded whatever its rows' sizes); each chunk is rendered
(`shardline.data.render`) in a worker process (one per core, from `POOL_MIN_EXAMPLES` examples on; in this
process below that) and written as one `.npz` of flat token ids, loss flags and document lengths per split, plus
the examples as JSON lines, renamed into place when complete. A preparation interrupted and started again finds the
chunks already written and skips their tokenization. No pickle is written or read: arrays only.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from shardline.data.render import render_many, text_ids
from shardline.data.sources import SPLITS, Source, read_examples
from shardline.data.splits import Assignment
from shardline.data.tokenizer import load_tokenizer
from shardline.errors import DataError
from shardline.example import Example
from shardline.spec import JobSpec
from shardline.tasks import get_task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CHUNK = 4096
CHUNK_CHARS = 8 << 20
"""A chunk ends early where its examples' texts pass this many characters (4,096 rows of 2 KB): a chunk is held,
sent to a worker, tokenized and written whole, a few times over, up to 2 × cores chunks at once (4,096 rows of
books would be gigabytes each)."""
POOL_MIN_EXAMPLES = 50_000
Advance = Callable[[int, int], None]
"""(examples, tokens) done since the last call."""


@dataclass(frozen=True)
class EncodeSettings:
    tokenizer_dir: str
    task: str
    prompt_format: str
    assistant_turns: str
    seq_len: int
    pairs: bool
    """Preference pairs become two documents (chosen, then rejected) packed together (`train.objective: dpo`);
    otherwise a pair trains its chosen completion."""

    @classmethod
    def of(cls, spec: JobSpec, tokenizer_dir: Path) -> EncodeSettings:
        d = spec.data
        return cls(str(tokenizer_dir), str(d.task), d.prompt_format, d.assistant_turns, spec.train.seq_len,
                   spec.train.objective == "dpo")


_worker: dict = {}


def _init(settings: EncodeSettings) -> None:
    _worker.update(settings=settings, tok=load_tokenizer(settings.tokenizer_dir),
                   template=get_task(settings.task).prompt)  # type: ignore[arg-type]


def encode_chunk(items: list[tuple[str, Example, int]]) -> dict[str, np.ndarray]:
    """Render (split, example, times) items into per-split flat ids, loss flags and document lengths; a text is
    cut into pieces of at most seq_len tokens, others longer than seq_len are counted as dropped, `times` times
    (kept and dropped add up to what the examples file lists; those far longer found without tokenizing them whole:
    `render_many`'s `max_tokens`). With pairs, a preference example is two documents, chosen then rejected, flagged
    `joined` (packed into one row together) and dropped as too long when the two do not fit one row."""
    s: EncodeSettings = _worker["settings"]
    tok, template = _worker["tok"], _worker["template"]
    out: dict[str, list] = {f"{split}.{k}": [] for split in SPLITS for k in ("ids", "loss", "lengths", "joined")}
    too_long = Counter()
    # Texts are cut below; an example certainly longer than a row is not tokenized whole (render_many: None).
    docs = [doc for _, ex, _ in items if s.pairs or ex.kind != "text" for doc in _documents(ex, s.pairs)]
    rendered = iter(render_many(tok, docs, template, s.prompt_format,  # type: ignore[arg-type]
                                s.assistant_turns, max_tokens=s.seq_len))
    for split, ex, times in items:
        if ex.kind == "text":
            pieces = _text_pieces(tok, ex.text or "", s.seq_len)
        else:
            r = next(rendered)
            if s.pairs:
                other = next(rendered)
                if r is None or other is None or len(r.ids) + len(other.ids) > s.seq_len:
                    too_long[split] += times  # as often as the examples file lists it
                    continue
                for _ in range(times):
                    for k, (piece_ids, piece_loss) in enumerate(((r.ids, r.loss), (other.ids, other.loss))):
                        out[f"{split}.ids"].append(np.asarray(piece_ids, dtype=np.int32))
                        out[f"{split}.loss"].append(_first_not_target(piece_loss))
                        out[f"{split}.lengths"].append(len(piece_ids))
                        out[f"{split}.joined"].append(k == 0)
                continue
            if r is None or len(r.ids) > s.seq_len:
                too_long[split] += times  # as often as the examples file lists it
                continue
            pieces = [(np.asarray(r.ids, dtype=np.int32), np.asarray(r.loss, dtype=np.uint8))]
        for _ in range(times):
            for piece_ids, piece_loss in pieces:
                out[f"{split}.ids"].append(piece_ids)
                out[f"{split}.loss"].append(piece_loss)
                out[f"{split}.lengths"].append(len(piece_ids))
                out[f"{split}.joined"].append(False)
    arrays = {}
    for split in SPLITS:
        ids = out[f"{split}.ids"]
        arrays[f"{split}.ids"] = np.concatenate(ids) if ids else np.zeros(0, np.int32)
        arrays[f"{split}.loss"] = np.concatenate(out[f"{split}.loss"]) if ids else np.zeros(0, np.uint8)
        arrays[f"{split}.lengths"] = np.asarray(out[f"{split}.lengths"], dtype=np.int32)
        arrays[f"{split}.joined"] = np.asarray(out[f"{split}.joined"], dtype=np.bool_)
        arrays[f"{split}.too_long"] = np.asarray([too_long[split]], dtype=np.int64)
    return arrays


def _text_pieces(tok: PreTrainedTokenizerBase, text: str, seq_len: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """A text's ids and loss flags in pieces of at most seq_len tokens, each starting afresh: its first token has
    nothing before it to be predicted from."""
    ids = text_ids(tok, text)
    pieces = []
    for a in range(0, len(ids), seq_len):
        loss = np.ones(min(seq_len, len(ids) - a), dtype=np.uint8)
        loss[0] = 0
        pieces.append((ids[a : a + seq_len], loss))
    return pieces


def _documents(ex: Example, pairs: bool) -> tuple[Example, ...]:
    """What `ex` renders to: a pair's chosen and rejected examples (with pairs), else the example itself (a pair
    trains its chosen completion under SFT)."""
    if not pairs:
        return (ex.chosen_and_rejected()[0],) if ex.preference else (ex,)
    if not ex.preference:
        where = f"source {ex.source}" if ex.source else "the data"
        raise DataError(where, f"has a {ex.kind} example where train.objective=dpo needs preference pairs",
                        "give every source prompt/chosen/rejected rows (data.format=preference, docs/data.md)")
    return ex.chosen_and_rejected()


def _first_not_target(loss: list[int]) -> np.ndarray:
    """A pair's document's loss flags with its first token not a target: in a row, it follows the other document."""
    flags = np.asarray(loss, dtype=np.uint8)
    flags[0] = 0
    return flags


def examples_in_order(source: Source, a: Assignment) -> Iterator[tuple[str, Example, int]]:
    """(split, example, times in the mixture) for every readable example of `source`, in stream order (the
    generated set: train, test, validation), each example named by its source."""
    if source.bundled is not None:
        examples: Iterator[Example] = (ex for split in ("train", "test", "validation")
                                       for ex in source.bundled[split])
    else:
        examples = (ex for _, ex in read_examples(source.rows(), source.reading, Counter()))
    ordinal = extra_at = 0
    for i, ex in enumerate(examples):
        split = a.held.get(i, "train")
        times = 1
        if split == "train":
            times = a.repeats
            if extra_at < len(a.extra) and a.extra[extra_at] == ordinal:
                times += 1
                extra_at += 1
            ordinal += 1
        yield split, replace(ex, source=source.name), times


def _chunks(items: Iterator[tuple[str, Example, int]]) -> Iterator[list[tuple[str, Example, int]]]:
    chunk: list[tuple[str, Example, int]] = []
    chars = 0
    for item in items:
        chunk.append(item)
        chars += _chars(item[1])
        if len(chunk) == CHUNK or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _chars(ex: Example) -> int:
    """The characters of an example's texts."""
    turns = sum(len(m.get("content") or "") for m in (*ex.messages, *ex.rejected_turns))
    return (len(ex.text or "") + len(ex.question) + len(ex.context) + len(ex.answer) + len(ex.prompt or "")
            + len(ex.rejected or "") + turns)


def chunk_path(work: Path, source_index: int, chunk: int) -> Path:
    return work / "chunks" / f"{source_index:03d}-{chunk:07d}.npz"


def encode_source(source: Source, index: int, a: Assignment, settings: EncodeSettings, work: Path,
                  advance: Advance | None = None) -> int:
    """Write `source`'s chunks under `work/chunks/` (those already there are kept); returns the number of chunks.
    At most two chunks per worker are in memory at once, whatever the source's size."""
    (work / "chunks").mkdir(parents=True, exist_ok=True)
    workers = _cores() if a.examples >= POOL_MIN_EXAMPLES else 1
    n_chunks = 0
    if workers <= 1:
        _init(settings)
        for n_chunks, chunk in enumerate(_chunks(examples_in_order(source, a)), 1):
            if not _skip(work, index, n_chunks - 1, chunk, advance):
                _write(n_chunks - 1, chunk, encode_chunk(chunk), work, index, advance)
        return n_chunks
    context = multiprocessing.get_context("forkserver")
    with _main_not_rerun(), ProcessPoolExecutor(workers, mp_context=context, initializer=_init,
                                                initargs=(settings,)) as pool:
        in_flight: deque[tuple[int, list, Future]] = deque()
        for n_chunks, chunk in enumerate(_chunks(examples_in_order(source, a)), 1):
            if _skip(work, index, n_chunks - 1, chunk, advance):
                continue
            in_flight.append((n_chunks - 1, chunk, pool.submit(encode_chunk, chunk)))
            while len(in_flight) > 2 * workers or (in_flight and in_flight[0][2].done()):
                k, done, future = in_flight.popleft()
                _write(k, done, future.result(), work, index, advance)
        for k, done, future in in_flight:
            _write(k, done, future.result(), work, index, advance)
    return n_chunks


@contextmanager
def _main_not_rerun() -> Iterator[None]:
    """Workers start without running the caller's script again: multiprocessing re-imports a `__main__` that has a
    file (a user's script calling `prepare` without an `if __name__ == "__main__"` guard would run twice)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or getattr(main, "__spec__", None) is not None:
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def _skip(work: Path, index: int, k: int, chunk: list, advance: Advance | None) -> bool:
    """A chunk a previous, interrupted preparation completed."""
    if not chunk_path(work, index, k).exists():
        return False
    if advance:
        advance(len(chunk), 0)
    return True


def _write(k: int, chunk: list, arrays: dict, work: Path, index: int, advance: Advance | None) -> None:
    examples = {split: "".join((json.dumps(ex.to_dict()) + "\n") * times for s, ex, times in chunk if s == split)
                for split in SPLITS}  # a training example repeated by the mixture is listed as often as it trains
    for split, text in examples.items():
        arrays[f"{split}.examples"] = np.frombuffer(text.encode(), dtype=np.uint8)
    final = chunk_path(work, index, k)
    tmp = final.with_name(f".{final.stem}.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, final)  # complete or absent: a resumed preparation trusts what it finds
    if advance:
        advance(len(chunk), int(sum(len(arrays[f"{s}.ids"]) for s in SPLITS)))


def read_chunk(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
