"""The run's JSON-lines files (metrics.jsonl): reading every whole record (a torn last line skipped), and ending a
torn last line before appending to it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    """The records of `path` in order; [] when it does not exist. A line that is not JSON (the torn last line
    of an attempt that was killed while writing) is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    with path.open() as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append(record)
    return out


class JsonlTail:
    """The records of a JSON-lines file, read incrementally: each `read()` parses only the whole lines appended
    since the last one (a long run's metrics.jsonl is not re-read at every checkpoint). `keep` may shrink each
    record to the fields its reader needs."""

    def __init__(self, path: Path, keep: Callable[[dict], dict] = lambda r: r) -> None:
        self.path, self.keep = Path(path), keep
        self.offset = 0
        self.records: list[dict] = []

    def read(self) -> list[dict]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return self.records
        whole = data.rfind(b"\n") + 1  # a line still being written is read next time
        for line in data[:whole].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                self.records.append(self.keep(record))
        self.offset += whole
        return self.records


def end_torn_line(path: Path) -> None:
    """Terminate a last line left unterminated by a writer that was killed mid-write, so this writer's first
    record starts a line of its own (appended to the torn one, it would be lost with it)."""
    try:
        with path.open("rb+") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
    except FileNotFoundError:
        pass
