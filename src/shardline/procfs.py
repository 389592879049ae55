"""Facts about processes on this Linux host, from /proc: state, start ticks, start time."""

from __future__ import annotations

import os
import time
from pathlib import Path


def proc_stat(pid: int | str) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of a Linux process ("self": this one); None when there is
    none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0], int(fields[19])


def process_age(pid: int | None = None) -> float | None:
    """Seconds since the process (default: this one, by /proc/self — right even where /proc belongs to another
    PID namespace) was created, at clock-tick resolution; None without procfs."""
    stat = proc_stat("self" if pid is None else pid)
    if stat is None:
        return None
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])  # 10 ms resolution; btime is whole seconds
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - stat[1] / os.sysconf("SC_CLK_TCK"))


def process_start_epoch(pid: int | None = None) -> float | None:
    """When the process was created (epoch seconds); None without procfs."""
    age = process_age(pid)
    return None if age is None else time.time() - age
