"""Times as runs record them: epoch seconds from a manifest value, and durations for people."""

from __future__ import annotations

import time
from datetime import datetime


def epoch(value) -> float | None:
    """Epoch seconds from a number or an ISO-8601 string (manifest times); None for None or an unreadable value."""
    if value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


def format_duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`."""
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Laps:
    """Named laps of one stopwatch: `lap(name)` records the seconds since the previous lap (or since creation)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + now - self._last, 3)
        self._last = now

    def line(self) -> str:
        """`build 0.4s · weights 15.3s`, for people (durations under a second keep a decimal)."""
        return " · ".join(f"{name} {s:.1f}s" if s < 10 else f"{name} {format_duration(s)}"
                          for name, s in self.seconds.items())
