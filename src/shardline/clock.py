"""Times as runs record them: epoch seconds from a manifest value, and durations for people."""

from __future__ import annotations

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
