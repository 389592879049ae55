"""Reading the run's JSON-lines files (metrics.jsonl): every whole record, a torn last line skipped."""

from __future__ import annotations

import json
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
