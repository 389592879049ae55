"""Where examples come from: the task's own data set (`data.task`), a local JSONL/Parquet file, or a hub dataset.

Every source yields the same three fields (`question`, `context`, `answer`) plus an optional `db_id`
(text-to-SQL: the generated database a query runs against). Bad rows are counted by reason, never silently
dropped.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardline.data.example import Example
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


def load_source(spec: DataSpec) -> SourceData:
    if spec.path is None:
        return _bundled(spec)
    rows, fingerprint = _read_rows(spec.path)
    return _split_rows(rows, spec, fingerprint)


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


def _read_rows(path_or_name: str) -> tuple[Iterable[dict[str, Any]], str]:
    path = Path(path_or_name).expanduser()
    if path.suffix in (".jsonl", ".json", ".parquet") or path.exists():
        if not path.is_file():
            raise DataError(str(path), "data file not found", "set data.path to a .jsonl or .parquet file")
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        if path.suffix == ".parquet":
            return _parquet_rows(path), digest.hexdigest()
        if path.suffix in (".jsonl", ".json"):
            return _jsonl_rows(path), digest.hexdigest()
        raise DataError(str(path), f"unsupported file type '{path.suffix}'", "use .jsonl or .parquet")
    return _hub_rows(path_or_name)


def _jsonl_rows(path: Path) -> Iterator[dict[str, Any]]:
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}", f"not valid JSON ({e.msg})", "fix or remove the line") from e
            yield row if isinstance(row, dict) else {}


def _parquet_rows(path: Path) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
        yield from batch.to_pylist()


def _hub_rows(name: str) -> tuple[Iterable[dict[str, Any]], str]:
    try:
        import datasets
    except ImportError as e:
        raise DataError(
            f"data.path={name}", "is not a local file, and hub datasets need the 'datasets' package",
            "pip install 'shardline[hub]', or download the dataset to a .jsonl/.parquet file",
        ) from e
    ds = datasets.load_dataset(name, split="train")
    return iter(ds), f"hub:{name}:{ds._fingerprint}"


def _split_rows(rows: Iterable[dict[str, Any]], spec: DataSpec, fingerprint: str) -> SourceData:
    cols = spec.columns
    dropped: Counter = Counter()
    by_question: dict[str, list[Example]] = {}
    n = 0
    for row in rows:
        n += 1
        values = [row.get(c) for c in (cols.question, cols.context, cols.answer)]
        if any(v is None for v in values):
            dropped["missing_column"] += 1
            continue
        question, context, answer = (str(v).strip() for v in values)
        if not question or not answer:
            dropped["empty"] += 1
            continue
        ex = Example(question=question, context=context, answer=answer, db_id=str(row.get("db_id") or ""))
        by_question.setdefault(question, []).append(ex)
    if n and not by_question:
        raise DataError(
            spec.path or "data", f"none of {n} rows has the columns {cols.model_dump()}",
            "map your column names with data.columns.question/context/answer",
        )
    # Split by unique question so that no question is in two splits.
    questions = sorted(by_question)
    random.Random(spec.seed).shuffle(questions)
    n_test, n_val = spec.test_size, spec.validation_size
    if len(questions) <= n_test + n_val:
        raise DataError(
            spec.path or "data", f"only {len(questions)} unique questions, not enough for "
            f"data.test_size={n_test} + data.validation_size={n_val} plus training data",
            "lower data.test_size / data.validation_size or use more data",
        )
    parts = {
        "test": questions[:n_test],
        "validation": questions[n_test : n_test + n_val],
        "train": questions[n_test + n_val :],
    }
    splits = {name: [ex for q in qs for ex in by_question[q]] for name, qs in parts.items()}
    if spec.train_size is not None:
        splits["train"] = splits["train"][: spec.train_size]
    settings = f"{fingerprint}:{spec.seed}:{spec.train_size}:{n_val}:{n_test}:{cols.model_dump_json()}"
    return SourceData(
        splits=splits, fingerprint=hashlib.sha256(settings.encode()).hexdigest(), dropped=dropped, rows_read=n
    )
