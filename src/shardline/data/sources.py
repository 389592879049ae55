"""Where examples come from: the task's own data set (`data.task`), local files (.jsonl, .json arrays, .parquet; a
file, a directory of shards or a glob), or a hub dataset.

A source is fingerprinted from its bytes and read as a stream of rows, each read by its data format
(`shardline.data.formats`) into an `Example`; nothing here holds a source in memory, nor a row over
`MAX_ROW_BYTES` (`shardline.data.rowfiles`: skipped unread, counted as `too_large`). Rows that cannot be read are
counted by reason, never silently dropped; rows that are not what their format says (a number where text belongs)
are errors naming the row.
"""

from __future__ import annotations

import glob
import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from shardline.data.example import Example
from shardline.data.formats import RowProblem, detect
from shardline.data.rowfiles import TooLarge, json_array, json_lines
from shardline.errors import DataError
from shardline.spec import DataSpec, SourceSpec
from shardline.tasks import get_task

SPLITS = ("train", "validation", "test")


@dataclass(frozen=True)
class Source:
    """One source of examples: a user's rows read by their format, or the task's own generated set (`bundled`)."""

    name: str
    weight: float
    fingerprint: str
    """sha256 of the source's content (files' names and bytes, a hub dataset's fingerprint, the generated set)."""
    reading: DataSpec
    """How its rows read: `data` with this source's path, format and columns."""
    rows: Callable[[], Rows] | None = None
    """A fresh pass over its rows (None for the generated set)."""
    bundled: dict[str, list[Example]] | None = None
    """The generated set, already split."""


def open_sources(spec: DataSpec) -> list[Source]:
    """The sources `data` names (`data.sources`, or the one `data.path`, or the task's own set), fingerprinted from
    their bytes without reading a row; none for random-token rows (`shardline.data.synthetic`)."""
    if spec.task == "random_tokens":
        return []
    if not spec.sources and spec.path is None:
        return [_bundled(spec)]
    entries = spec.sources or [SourceSpec(path=spec.path or "", format=spec.format, columns=spec.columns)]
    sources = []
    for entry in entries:
        reading = spec.model_copy(update={"path": entry.path, "format": entry.format, "columns": entry.columns,
                                          "sources": []})
        rows, fingerprint = _read_rows(entry.path)
        sources.append(Source(name=entry.name or _source_name(entry.path), weight=entry.weight,
                              fingerprint=fingerprint, reading=reading, rows=rows))
    return sources


def _source_name(path: str) -> str:
    """A file's stem, a directory's name, a glob's directory, a hub dataset's name."""
    location = Path(path.rstrip("/"))
    if any(ch in location.name for ch in "*?["):
        location = location.parent
    name = location.name or path
    return Path(name).stem if Path(name).suffix in SUFFIXES else name


def head_examples(spec: DataSpec, n: int) -> list[Example]:
    """The first `n` readable examples of each source, read as preparation will read them (a preflight check that
    fails on bad data before a run directory exists)."""
    out: list[Example] = []
    for source in open_sources(spec):
        if source.rows is not None:
            out += [ex for _, ex in read_examples(source.rows(), source.reading, Counter(), limit=n)]
    return out


def _bundled(spec: DataSpec) -> Source:
    return _bundled_for(spec.model_dump_json())


@lru_cache(maxsize=1)
def _bundled_for(data_json: str) -> Source:
    """The generated set, built once per process for the last `data` asked: a worker prepares twice (to write,
    then to read) and the launcher once before it, each generating and hashing thousands of examples otherwise."""
    return _generate_bundled(DataSpec.model_validate_json(data_json))


def _generate_bundled(spec: DataSpec) -> Source:
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
    return Source(name="generated", weight=1.0, fingerprint=digest.hexdigest(), reading=spec, bundled=splits)


ROW_ERRORS = ("not_text", "not_a_conversation", "unknown_role")
"""Row problems that are errors (the data is not what its format says); the others are counted drops."""
SUFFIXES = (".jsonl", ".json", ".parquet")
Rows = Iterable[tuple[str, Any]]
"""(where: `file:line` or `file#row`, the row) pairs; a row over `MAX_ROW_BYTES` is a `TooLarge`, never read."""
NAMED_TOO_LARGE = 5
"""Rows over the bound named in the warning that says how many were skipped."""


def _read_rows(path_or_name: str) -> tuple[Callable[[], Rows], str]:
    files = _local_files(path_or_name)
    if files is None:
        return _hub_rows(path_or_name)
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.name).encode())
        with path.open("rb") as f:
            for chunk in iter(lambda f=f: f.read(1 << 20), b""):
                digest.update(chunk)
    return (lambda: (pair for path in files for pair in _file_rows(path))), digest.hexdigest()


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
        yield from json_array(path)
    else:  # JSON lines (.jsonl, and .json files that hold one row per line)
        yield from json_lines(path)


def _starts_with(path: Path, prefix: bytes) -> bool:
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    return head.startswith(prefix)


def _hub_rows(name: str) -> tuple[Callable[[], Rows], str]:
    try:
        import datasets
    except ImportError as e:
        raise DataError(
            f"data.path={name}", "is not a local file, and hub datasets need the 'datasets' package",
            "pip install 'shardline[hub]', or download the dataset to a .jsonl/.parquet file",
        ) from e
    ds = datasets.load_dataset(name, split="train")
    return (lambda: ((f"{name}#{i}", row) for i, row in enumerate(ds, 1))), f"hub:{name}:{ds._fingerprint}"


def read_examples(rows: Rows, spec: DataSpec, dropped: Counter, limit: int | None = None,
                  found: dict[str, str] | None = None, too_large: list[tuple[str, int]] | None = None
                  ) -> Iterator[tuple[Any, Example]]:
    """(group key, example) for each readable row, in order; unreadable rows are counted in `dropped` by reason,
    or raise a DataError naming the row when the data is not what its format says. `limit`: stop after that many
    rows (a preflight look at the head of the data). `found["format"]` is set to the format detected. Rows over
    `MAX_ROW_BYTES`, skipped unread, are counted as `too_large`, and the first `NAMED_TOO_LARGE` of them listed in
    `too_large` as (where, bytes)."""
    fmt = None
    for n, (where, row) in enumerate(rows, 1):
        if limit is not None and n > limit:
            return
        if isinstance(row, TooLarge):
            dropped["too_large"] += 1
            if too_large is not None and len(too_large) < NAMED_TOO_LARGE:
                too_large.append((where, row.size))
            continue
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
            ex = fmt.read(row, spec.columns, spec.roles)
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
        yield key, ex
