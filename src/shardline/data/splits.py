"""Which examples go where, decided in one streaming pass: the held-out splits of each source, and how many times
each training example enters the mixture.

A source is split by row (or by `data.group_by`: whole groups), with a draw seeded by `data.seed` and the source's
place in the list; `data.test_size` and `data.validation_size` rows per source are held out, exactly (an unset
validation size: `VALIDATION_SHARE` of the source's rows, at most `MAX_VALIDATION_ROWS`), and the rest trains.
The training mixture gives each source its weight's share of the training examples (`data.train_size` caps the
total): a share below the source's rows is a seeded subset of them, a larger one repeats them (whole
passes, then a seeded subset). Memory is a few bytes per row, never the rows themselves.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from array import array
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from shardline.data.rowfiles import MAX_ROW_BYTES
from shardline.data.sources import Source, read_examples
from shardline.errors import DataError
from shardline.example import Example
from shardline.spec import DataSpec

log = logging.getLogger(__name__)
NAMED_COPIES = 5
"""Held-out rows that are also training rows named in the warning that counts them."""
VALIDATION_SHARE, MAX_VALIDATION_ROWS = 0.05, 200
"""`data.validation_size` unset: 5 % of a source's rows (at least one), at most 200 (as the generated set holds)."""
PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][\w.]*)\s*\}\}")
"""A template's placeholder left in the text (`{{name}}`: LLaMA-Factory's identity.json has `{{name}}` and
`{{author}}`, to be filled in before training)."""


@dataclass
class Assignment:
    """A source's examples (in stream order, readable rows only) by split, and its training multiplicities."""

    examples: int
    held: dict[int, str]
    """Example index → `test` or `validation`; every other example trains."""
    dropped: Counter = field(default_factory=Counter)
    format: str = "question_answer"
    repeats: int = 1
    """Every training example enters the mixture this many times (0 when the source's share is below its size) …"""
    extra: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """… and the training examples of these ordinals (sorted, among training examples) once more."""

    @property
    def train_examples(self) -> int:
        return self.examples - len(self.held)

    @property
    def mixed(self) -> int:
        """Training examples this source contributes to the mixture."""
        return self.repeats * self.train_examples + len(self.extra)


def assign(source: Source, index: int, data: DataSpec) -> Assignment:
    """One pass over `source`: count and check its rows, and draw its held-out examples."""
    if source.bundled is not None:  # the generated set comes split
        order = [(i, split) for split in ("test", "validation") for i in range(len(source.bundled[split]))]
        n_train = len(source.bundled["train"])
        held = {n_train + k: split for k, (_, split) in enumerate(order)}
        pairs = data.format == "preference"  # the generated set drawn as pairs (train.objective: dpo)
        return Assignment(examples=n_train + len(order), held=held,
                          format="preference" if pairs else "question_answer")
    dropped: Counter = Counter()
    found: dict[str, str] = {}
    too_large: list[tuple[str, int]] = []
    placeholders: Counter = Counter()
    with_placeholders: list[int] = []
    groups, digests = array("Q"), array("Q")
    n = 0
    for key, ex in read_examples(source.rows(), source.reading, dropped, found=found, too_large=too_large):
        n += 1
        digests.append(_digest(ex))
        if data.group_by is not None:
            groups.append(int.from_bytes(hashlib.blake2b(str(key).encode(), digest_size=8).digest(), "little"))
        names = {m.group(1) for text in _texts(ex) for m in PLACEHOLDER.finditer(text)}
        if names:
            placeholders.update(names)
            with_placeholders.append(n)
    if too_large:
        _say_too_large(source, dropped["too_large"], too_large)
    if placeholders:
        _say_placeholders(source, placeholders, with_placeholders)
    if n == 0:
        raise DataError(source.reading.path or source.name, f"no row could be read (dropped: {dict(dropped)})",
                        "check the rows against data.format (docs/data.md)")
    n_test, n_val = data.test_size or 0, validation_rows(data, n)
    if n <= n_test + n_val:
        raise DataError(source.reading.path or source.name, f"only {n} rows, not enough for data.test_size={n_test}"
                        f" + data.validation_size={n_val} plus training data",
                        "lower data.test_size / data.validation_size or use more data")
    rng = np.random.default_rng([data.seed, index])
    if data.group_by is None:
        chosen = rng.choice(n, n_test + n_val, replace=False)
        held = {int(i): "test" for i in chosen[:n_test]} | {int(i): "validation" for i in chosen[n_test:]}
    else:
        held = _held_groups(np.frombuffer(groups, dtype=np.uint64), n_test, n_val, rng, data.group_by)
    _say_held_out_copies(source, np.frombuffer(digests, dtype=np.uint64), held)
    return Assignment(examples=n, held=held, dropped=dropped, format=found["format"])


def validation_rows(data: DataSpec, rows: int) -> int:
    """`data.validation_size`, or for a user's source without one its share of the source's `rows`."""
    if data.validation_size is not None:
        return data.validation_size
    return min(MAX_VALIDATION_ROWS, max(1, round(VALIDATION_SHARE * rows)))


def _texts(ex) -> list[str]:
    """The texts of an example that training reads."""
    texts = [ex.question, ex.context, ex.answer, ex.prompt or "", ex.system, ex.text or "", ex.rejected or ""]
    return texts + [m["content"] for m in (*ex.messages, *ex.rejected_turns) if isinstance(m.get("content"), str)]


def _say_placeholders(source: Source, names: Counter, rows: list[int]) -> None:
    """Placeholders are trained as written (a model that answers `I am {{name}}`): the warning names them."""
    shown = ", ".join(f"{{{{{name}}}}} ({count:,} row{'s' if count > 1 else ''})"
                      for name, count in names.most_common(5)) + (", …" if len(names) > 5 else "")
    log.warning("%s: %s of its rows contain template placeholders, trained as written: %s (the first: example %s "
                "of the source). Fill them in before training (LLaMA-Factory's identity.json: replace {{name}} and "
                "{{author}} with your model's name and yours), or ignore this if the text means them literally "
                "(template code)",
                source.reading.path or source.name, f"{len(rows):,}", shown, rows[0])


def _say_too_large(source: Source, count: int, named: list[tuple[str, int]]) -> None:
    """Rows over the bound are counted in the summary's drops; the warning says which (the first few) and why."""
    where = ", ".join(f"{at} ({size:,} bytes)" for at, size in named) + (", …" if count > len(named) else "")
    log.warning("%s: %s over %s MiB skipped unread, counted as too_large: %s. Each row is read whole before it is "
                "split or cut (a text into pieces of train.seq_len tokens), so rows are bounded: split such documents "
                "into several rows, or leave out the columns that are not trained on (docs/data.md)",
                source.reading.path or source.name, f"{count:,} row{'s' if count > 1 else ''}",
                MAX_ROW_BYTES >> 20, where)


def _digest(ex: Example) -> int:
    """8 bytes that tell an example from another (as read: columns not read, such as a row id, play no part)."""
    text = json.dumps(ex.to_dict(), sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def _say_held_out_copies(source: Source, digests: np.ndarray, held: dict[int, str]) -> None:
    """Held-out examples that are also training examples, exactly, counted and the first few named by row: the
    validation loss (and test scores) would measure rows trained on."""
    at = np.fromiter(held, dtype=np.int64, count=len(held))
    trains = np.ones(len(digests), dtype=bool)
    trains[at] = False
    copies = at[np.isin(digests[at], digests[trains])]
    if not len(copies):
        return
    wheres = dict.fromkeys(sorted(copies.tolist())[:NAMED_COPIES], "")
    last = max(wheres)
    for i, _ in enumerate(read_examples(source.rows(), source.reading, Counter(), wheres=wheres)):
        if i >= last:
            break
    by_split = Counter(held[int(i)] for i in copies)
    log.warning("%s: %s held-out row%s (%s) also in training, the same example: %s%s. The held-out loss would "
                "measure rows trained on; remove the copies, or keep them in one split with data.group_by (a "
                "column they share)", source.reading.path or source.name, f"{len(copies):,}",
                "s" * (len(copies) > 1), ", ".join(f"{k}: {v:,}" for k, v in sorted(by_split.items())),
                ", ".join(wheres.values()), f" and {len(copies) - len(wheres):,} more" if len(copies) > len(wheres)
                else "")


def _held_groups(keys: np.ndarray, n_test: int, n_val: int, rng: np.random.Generator, column: str
                 ) -> dict[int, str]:
    """Whole groups, drawn in a seeded order, fill test then validation until each holds the rows asked."""
    unique, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    split_of = np.full(len(unique), 0, dtype=np.uint8)  # 0 train, 1 test, 2 validation
    filled = {1: 0, 2: 0}
    for g in rng.permutation(len(unique)):
        target = 1 if filled[1] < n_test else 2 if filled[2] < n_val else 0
        if target == 0:
            break
        split_of[g] = target
        filled[target] += int(counts[g])
    if not (split_of == 0).any():
        raise DataError(f"data.group_by={column}", "leaves no group for training",
                        "lower data.test_size / data.validation_size, or group by a finer column")
    rows = split_of[inverse]
    return {int(i): ("test" if rows[i] == 1 else "validation") for i in np.flatnonzero(rows)}


def draw_mixture(sources: list[Source], assignments: list[Assignment], data: DataSpec) -> None:
    """Set each assignment's training multiplicities: its weight's share of the mixture's training examples."""
    available = sum(a.train_examples for a in assignments)
    total = min(available, data.train_size) if data.train_size is not None else available
    weights = np.array([s.weight for s in sources], dtype=np.float64)
    for i, (source, a) in enumerate(zip(sources, assignments, strict=True)):
        share = round(total * weights[i] / weights.sum())
        a.repeats, rest = divmod(share, a.train_examples)
        rng = np.random.default_rng([data.seed, i, 1])
        a.extra = np.sort(rng.choice(a.train_examples, rest, replace=False)) if rest else a.extra
        if share == 0:
            raise DataError(f"data.sources ({source.name})", f"its weight {source.weight} gives it no training "
                            f"example of {total}", "raise its weight, or drop the source")
