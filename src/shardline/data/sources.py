"""Where examples come from: the task's own data set (`data.task`), local files (.jsonl, .json arrays, .parquet; a
file, a directory of shards or a glob), or a hub dataset.

Rows are read by their data format (`shardline.data.formats`) into `Example`s and split by row (or by
`data.group_by`) into train/validation/test. Rows that cannot be read are counted by reason, never silently
dropped; rows that are not what their format says (a number where text belongs) are errors naming the row.
"""

from __future__ import annotations

import glob
import hashlib
import json
import random
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from shardline.data.example import Example
from shardline.data.formats import RowProblem, detect
from shardline.errors import DataError
from shardline.spec import DataSpec
from shardline.tasks import get_task

SPLITS = ("train", "validation", "test")


@dataclass
class SourceData:
    splits: dict[str, list[Example]]
    fingerprint: str
    """sha256 of the source content and split settings: part of the dataset version."""
    dropped: Counter = field(default_factory=Counter)
    rows_read: int = 0
    format: str = "question_answer"
    """The data format its rows were read in (`shardline.data.formats`)."""


def load_source(spec: DataSpec) -> SourceData:
    if spec.path is None:
        return _bundled(spec)
    rows, fingerprint = _read_rows(spec.path)
    return _split_rows(rows, spec, fingerprint)


def head_examples(spec: DataSpec, n: int) -> list[Example]:
    """The first `n` readable examples of the source, read as preparation will read them (a preflight check that
    fails on bad data before a run directory exists)."""
    if spec.path is None:
        return []
    rows, _ = _read_rows(spec.path)
    return [ex for _, ex in read_examples(rows, spec, Counter(), limit=n)]


def _bundled(spec: DataSpec) -> SourceData:
    task = get_task(spec.task)
    if task.bundled_splits is None:
        raise DataError("data.path", f"is unset, and data.task={spec.task} brings no data of its own",
                        "set data.path to your .jsonl/.parquet file or hub dataset, or data.task=text_to_sql "
                        "for the generated text-to-SQL set")
    splits = task.bundled_splits(spec)
    digest = hashlib.sha256()
    for name in SPLITS:
        for ex in splits[name]:
            digest.update(json.dumps([name, *ex.to_dict().values()]).encode())
    n = sum(len(v) for v in splits.values())
    return SourceData(splits=splits, fingerprint=digest.hexdigest(), rows_read=n)


ROW_ERRORS = ("not_text", "not_a_conversation", "unknown_role")
"""Row problems that are errors (the data is not what its format says); the others are counted drops."""
SUFFIXES = (".jsonl", ".json", ".parquet")
Rows = Iterable[tuple[str, Any]]
"""(where: `file:line` or `file#row`, the row) pairs."""


def _read_rows(path_or_name: str) -> tuple[Rows, str]:
    files = _local_files(path_or_name)
    if files is None:
        return _hub_rows(path_or_name)
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.name).encode())
        with path.open("rb") as f:
            for chunk in iter(lambda f=f: f.read(1 << 20), b""):
                digest.update(chunk)
    return (pair for path in files for pair in _file_rows(path)), digest.hexdigest()


def _local_files(path_or_name: str) -> list[Path] | None:
    """The data files `data.path` names: a file, a directory's shards, a glob's matches; None: a hub name."""
    path = Path(path_or_name).expanduser()
    if any(ch in path_or_name for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).suffix in SUFFIXES)
        if not files:
            raise DataError(f"data.path={path_or_name}", "no .jsonl/.json/.parquet file matches the pattern",
                            "check the pattern (e.g. data/*.jsonl)")
        return files
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
        if not files:
            raise DataError(f"data.path={path_or_name}", "the directory holds no .jsonl/.json/.parquet file",
                            "point data.path at the directory of your shards or at one file")
        return files
    if path.suffix in SUFFIXES or path.exists() or path_or_name.startswith((".", "/", "~")):
        if not path.is_file():
            raise DataError(f"data.path={path_or_name}", "data file not found",
                            "set data.path to a .jsonl, .json or .parquet file, a directory or a glob of them")
        if path.suffix not in SUFFIXES:
            raise DataError(str(path), f"unsupported file type '{path.suffix}'", "use .jsonl, .json or .parquet")
        return [path]
    return None


def _file_rows(path: Path) -> Iterator[tuple[str, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        n = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            for row in batch.to_pylist():
                n += 1
                yield f"{path}#{n}", row
        return
    if path.suffix == ".json" and _starts_with(path, b"["):  # an array of rows (Alpaca's layout)
        try:
            rows = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}", f"not valid JSON ({e.msg})", "fix the file") from e
        for i, row in enumerate(rows, 1):
            yield f"{path}#{i}", row
        return
    with path.open() as f:  # JSON lines (.jsonl, and .json files that hold one row per line)
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}", f"not valid JSON ({e.msg})", "fix or remove the line") from e
            yield f"{path}:{lineno}", row


def _starts_with(path: Path, prefix: bytes) -> bool:
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    return head.startswith(prefix)


def _hub_rows(name: str) -> tuple[Rows, str]:
    try:
        import datasets
    except ImportError as e:
        raise DataError(
            f"data.path={name}", "is not a local file, and hub datasets need the 'datasets' package",
            "pip install 'shardline[hub]', or download the dataset to a .jsonl/.parquet file",
        ) from e
    ds = datasets.load_dataset(name, split="train")
    return ((f"{name}#{i}", row) for i, row in enumerate(ds, 1)), f"hub:{name}:{ds._fingerprint}"


def read_examples(rows: Rows, spec: DataSpec, dropped: Counter, limit: int | None = None,
                  found: dict[str, str] | None = None) -> Iterator[tuple[Any, Example]]:
    """(group key, example) for each readable row, in order; unreadable rows are counted in `dropped` by reason,
    or raise a DataError naming the row when the data is not what its format says. `limit`: stop after that many
    rows (a preflight look at the head of the data). `found["format"]` is set to the format detected."""
    fmt = None
    for n, (where, row) in enumerate(rows, 1):
        if limit is not None and n > limit:
            return
        if not isinstance(row, dict):
            raise DataError(where, f"is a {type(row).__name__}, not an object with columns",
                            "each row must be a JSON object (one per line in .jsonl, the elements of a .json array)")
        if fmt is None:
            fmt = detect(row, spec, where)
            if found is not None:
                found["format"] = fmt.name
            if spec.task == "text_to_sql" and fmt.name != "question_answer":
                raise DataError(where, f"data.task=text_to_sql scores generated SQL against each row's schema, but "
                                f"the rows are {fmt.name} rows", "use question/context/answer rows for it, or "
                                "data.task=none for other data")
        try:
            ex = fmt.read(row, spec.columns)
        except RowProblem as p:
            if p.reason in ROW_ERRORS:
                raise DataError(where, f"{p.field} {p.problem}",
                                f"fix the row, or map another column with data.columns (data.format={fmt.name})"
                                ) from p
            dropped[p.reason] += 1
            continue
        if spec.group_by is None:
            key: Any = n
        elif spec.group_by in row:
            key = json.dumps(row[spec.group_by], sort_keys=True, default=str)
        else:
            raise DataError(where, f"has no column {spec.group_by!r} (data.group_by)",
                            f"set data.group_by to one of {sorted(row)}, or unset it to split by row")
        yield key, replace(ex, source=spec.path or "")


def _split_rows(rows: Rows, spec: DataSpec, fingerprint: str) -> SourceData:
    dropped: Counter = Counter()
    groups: dict[Any, list[Example]] = {}
    found: dict[str, str] = {}
    for key, ex in read_examples(rows, spec, dropped, found=found):
        groups.setdefault(key, []).append(ex)
    n = sum(len(g) for g in groups.values())
    if not groups:
        raise DataError(spec.path or "data", f"no row could be read (dropped: {dict(dropped) or 'none'})",
                        "check the rows against data.format (docs/data.md)")
    # Whole groups (a row, without data.group_by) go to one split: test first, then validation, each until it
    # holds the rows asked; the rest trains.
    keys = list(groups)
    random.Random(spec.seed).shuffle(keys)
    n_test, n_val = spec.test_size or 0, spec.validation_size
    if n <= n_test + n_val:
        raise DataError(spec.path or "data", f"only {n} rows, not enough for data.test_size={n_test} + "
                        f"data.validation_size={n_val} plus training data",
                        "lower data.test_size / data.validation_size or use more data")
    splits: dict[str, list[Example]] = {name: [] for name in SPLITS}
    for key in keys:
        split = ("test" if len(splits["test"]) < n_test else
                 "validation" if len(splits["validation"]) < n_val else "train")
        splits[split].extend(groups[key])
    if not splits["train"]:
        raise DataError(spec.path or "data", f"data.group_by={spec.group_by} leaves no group for training",
                        "lower data.test_size / data.validation_size, or group by a finer column")
    if spec.train_size is not None:
        splits["train"] = splits["train"][: spec.train_size]
    settings = (f"{fingerprint}:{spec.seed}:{spec.train_size}:{n_val}:{n_test}:{spec.columns.model_dump_json()}:"
                f"{spec.format}:{spec.group_by}")
    return SourceData(
        splits=splits, fingerprint=hashlib.sha256(settings.encode()).hexdigest(), dropped=dropped, rows_read=n,
        format=found["format"])
