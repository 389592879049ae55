"""Where examples come from: the task's own data set (`data.task`), local files (.jsonl, .json arrays, .parquet; a
file, a directory of shards or a glob), a `datasets` save_to_disk directory, or a hub dataset.

A source is fingerprinted from its bytes and read as a stream of rows, each read by its data format
(`shardline.data.formats`) into an `Example`; nothing here holds a source in memory, nor a row over
`MAX_ROW_BYTES` (`shardline.data.rowfiles`: skipped unread, counted as `too_large`). Rows that cannot be read are
counted by reason, never silently dropped; rows that are not what their format says (a number where text belongs)
are errors naming the row. A directory reads its data files and names, in a warning, every file it does not read.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from shardline.data.formats import RowProblem, detect
from shardline.data.rowfiles import TooLarge, json_array, json_lines, starts_with
from shardline.errors import DataError
from shardline.example import Example
from shardline.spec import DataSpec, SourceSpec
from shardline.tasks import get_task

SPLITS = ("train", "validation", "test")
log = logging.getLogger(__name__)


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
    kind = data_kind(name)
    if kind is None:
        return name
    stem = name[:-3] if name.lower().endswith(".gz") else name
    return stem[: -len(kind)]


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
"""The data files read, their suffixes in any case; `.jsonl.gz` and `.json.gz` are read through gzip."""
READS = ".jsonl, .json, .jsonl.gz, .json.gz or .parquet"
HIDDEN = (".", "_")
"""A directory skips the files and folders whose names start with these (as pyarrow's datasets do): copies a tool
keeps beside the data (`.ipynb_checkpoints/`, `.git/`) and markers and work folders of writers (`_SUCCESS`,
`_temporary/`), which would add rows twice or leak held-out rows into training."""
SAVED_DATASET = (("dataset_info.json", "state.json"), ("dataset_dict.json",))
"""The files that make a directory a `datasets` save_to_disk directory: of a Dataset, or of a DatasetDict."""
NAMED = 10
"""Files named in the warning that lists what a directory skipped."""
Rows = Iterable[tuple[str, Any]]
"""(where: `file:line` or `file#row`, the row) pairs; a row over `MAX_ROW_BYTES` is a `TooLarge`, never read."""
NAMED_TOO_LARGE = 5
"""Rows over the bound named in the warning that says how many were skipped."""
_SAID: set[str] = set()
"""Warnings given in this process: sources are opened several times a run (preflight, prepare, each rank)."""


def data_kind(name: str) -> str | None:
    """The suffix (of `SUFFIXES`) by which a file of this name is read, matched in any case and through a `.gz`
    (a gzipped .parquet is not: parquet compresses inside); None for other files."""
    lower = name.lower()
    gz = lower.endswith(".gz")
    lower = lower.removesuffix(".gz")
    kind = next((s for s in SUFFIXES if lower.endswith(s) and len(lower) > len(s)), None)
    return None if kind == ".parquet" and gz else kind


def _say_once(message: str, *args: Any) -> None:
    text = message % args
    if text not in _SAID:
        _SAID.add(text)
        log.warning("%s", text)


def _read_rows(path_or_name: str) -> tuple[Callable[[], Rows], str]:
    path = Path(path_or_name).expanduser()
    if path.is_dir() and _is_saved_dataset(path):
        return _saved_rows(path)
    files = _local_files(path_or_name)
    if files is None:
        return _hub_rows(path_or_name)
    return (lambda: (pair for path in files for pair in _file_rows(path))), _files_digest(files)


def _files_digest(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.name).encode())
        with path.open("rb") as f:
            for chunk in iter(lambda f=f: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _local_files(path_or_name: str) -> list[Path] | None:
    """The data files `data.path` names: a file, a directory's shards, a glob's matches; None: a hub name. What a
    directory or a glob holds besides is named in a warning."""
    path = Path(path_or_name).expanduser()
    if any(ch in path_or_name for ch in "*?["):
        matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True))
        files = [p for p in matches if p.is_file() and data_kind(p.name)]
        if not files:
            raise DataError(f"data.path={path_or_name}", f"no {READS} file matches the pattern"
                            + _holding([str(p) for p in matches]), "check the pattern (e.g. data/*.jsonl)")
        _say_skipped(path_or_name, len(files), [str(p) + "/" * p.is_dir() for p in matches if p not in files])
        return files
    if path.is_dir():
        files, skipped = _directory_files(path)
        if not files:
            raise DataError(f"data.path={path_or_name}", f"the directory holds no {READS} file" + _holding(skipped),
                            "point data.path at the directory of your shards or at one file")
        _say_skipped(path_or_name, len(files), skipped)
        return files
    if data_kind(path.name) or path.exists() or path_or_name.startswith((".", "/", "~")):
        if not path.is_file():
            raise DataError(f"data.path={path_or_name}", "data file not found",
                            f"set data.path to a {READS} file, a directory or a glob of them")
        if not data_kind(path.name):
            raise DataError(str(path), f"unsupported file type '{path.suffix}'",
                            f"use {READS} (decompress other archives first)")
        return [path]
    return None


def _directory_files(root: Path) -> tuple[list[Path], list[str]]:
    """The data files under `root` (sorted: shards in order) and the rest, relative to it: files of other kinds and
    the hidden files and folders (`HIDDEN`: their contents are not looked at), a folder's name ending in '/'."""
    files, skipped = [], []
    for here, folders, names in os.walk(root, followlinks=True):
        at = Path(here)
        skipped += [f"{(at / d).relative_to(root)}/" for d in folders if d.startswith(HIDDEN)]
        folders[:] = sorted(d for d in folders if not d.startswith(HIDDEN))
        for name in names:
            if name.startswith(HIDDEN) or not data_kind(name):
                skipped.append(str((at / name).relative_to(root)))
            else:
                files.append(at / name)
    return sorted(files), sorted(skipped)


def _holding(names: list[str]) -> str:
    return f" (it holds {_names(names)})" if names else ""


def _names(names: list[str]) -> str:
    more = f", … ({len(names) - NAMED:,} more)" if len(names) > NAMED else ""
    return ", ".join(names[:NAMED]) + more


def _say_skipped(named: str, read: int, skipped: list[str]) -> None:
    """Every file a directory or glob holds but does not read, counted and named (the first `NAMED`)."""
    if not skipped:
        return
    folders = sum(name.endswith("/") for name in skipped)
    counts = [f"{n:,} {what}{'s' * (n > 1)}" for n, what in ((len(skipped) - folders, "file"),
                                                             (folders, "hidden folder")) if n]
    _say_once("data.path=%s: read %s data file%s; skipped %s: %s. A directory reads %s files, and skips names "
              "starting with '.' or '_' (tools' copies, writers' markers); name other files in data.path (a file, or a "
              "glob) to read them", named, f"{read:,}", "s" * (read > 1), " and ".join(counts), _names(skipped), READS)


def _is_saved_dataset(root: Path) -> bool:
    return any(all((root / name).is_file() for name in names) for names in SAVED_DATASET)


def _saved_rows(root: Path) -> tuple[Callable[[], Rows], str]:
    """The rows of a `datasets` save_to_disk directory (its `train` split, for a DatasetDict), as its Arrow files
    hold them (memory-mapped); fingerprinted from its files' names and bytes."""
    try:
        import datasets
    except ImportError as e:
        raise DataError(f"data.path={root}", "is a `datasets` save_to_disk directory, which is read with the "
                        "'datasets' package, not installed here", "pip install 'shardline[hub]'") from e
    try:
        ds = datasets.load_from_disk(str(root))
    except (OSError, ValueError, KeyError) as e:
        raise DataError(f"data.path={root}", f"looks like a `datasets` save_to_disk directory, but "
                        f"datasets.load_from_disk cannot read it ({e})", "save it again with save_to_disk, or "
                        "export its rows to .jsonl/.parquet") from e
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"data.path={root}", f"is a saved DatasetDict without a train split (it has "
                            f"{', '.join(sorted(ds))})", "point data.path at the split's own folder inside it")
        others = sorted(set(ds) - {"train"})
        if others:
            _say_once("data.path=%s: a saved DatasetDict; its train split is read, and %s not (shardline draws "
                      "its own validation and test rows from it: data.validation_size, data.test_size)", root,
                      ", ".join(others))
        ds = ds["train"]
    files = sorted(p for p in root.rglob("*") if p.is_file() and not any(
        part.startswith(HIDDEN) for part in p.relative_to(root).parts))  # its Arrow files and their descriptions
    return (lambda: ((f"{root}#{i}", row) for i, row in enumerate(ds, 1))), _files_digest(files)


def _file_rows(path: Path) -> Iterator[tuple[str, Any]]:
    kind = data_kind(path.name)
    if kind == ".parquet":
        import pyarrow.parquet as pq

        n = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            for row in batch.to_pylist():
                n += 1
                yield f"{path}#{n}", row
        return
    if kind == ".json" and starts_with(path, b"["):  # an array of rows (Alpaca's layout)
        yield from json_array(path)
    else:  # JSON lines (.jsonl, and .json files that hold one row per line)
        yield from json_lines(path)


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
                  found: dict[str, str] | None = None, too_large: list[tuple[str, int]] | None = None,
                  wheres: dict[int, str] | None = None) -> Iterator[tuple[Any, Example]]:
    """(group key, example) for each readable row, in order; unreadable rows are counted in `dropped` by reason,
    or raise a DataError naming the row when the data is not what its format says. `limit`: stop after that many
    rows (a preflight look at the head of the data). `found["format"]` is set to the format detected. Rows over
    `MAX_ROW_BYTES`, skipped unread, are counted as `too_large`, and the first `NAMED_TOO_LARGE` of them listed in
    `too_large` as (where, bytes). `wheres`: the examples (numbered from 0, as yielded) whose `where` (`file:line`,
    `file#row`) to fill in, to name them."""
    fmt = None
    yielded = 0
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
        if wheres is not None and yielded in wheres:
            wheres[yielded] = where
        yielded += 1
        yield key, ex
