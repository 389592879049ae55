"""What is true about a run, read from its directory alone: status (a run whose processes are gone is never
"running"), progress, elapsed time, ETA and projected cost; and the table of the runs in a directory.

Local launchers record their processes in the manifest (`processes`: pid, host, start ticks). A run whose
manifest says `starting`/`running` while every recorded process on this host is gone ended without telling
anyone (kill -9, OOM killer, a closed laptop): `settle` marks it `failed` with the last committed checkpoint, the
workers' failure records if they left any, and says so. Runs on other hosts or engines are left to their
engine's status: a pid means nothing on another host, so a live run there is known by its heartbeat in the run
directory (`rundir.claim_run`), reported alive or presumed dead, and never launched again while it beats.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, computed_field

from shardline.clock import epoch, format_duration
from shardline.errors import SpecError
from shardline.failures import failure_message, read_failures
from shardline.goodput import Goodput, compute_goodput
from shardline.jsonl import read_jsonl
from shardline.procfs import proc_stat
from shardline.rundir import (
    HEARTBEAT_STALE_S,
    LIVE,
    elsewhere,
    manifest_lock,
    read_manifest,
    refuse_if_alive_elsewhere,
    update_manifest,
    write_manifest,
)

Status = Literal["starting", "running", "finished", "preempted", "failed", "unknown"]
RECORD_PROCESSES_ENV = "SHARDLINE_RECORD_PROCESSES"
"""Set by the local launcher: its workers add themselves to the manifest's processes (all on this host)."""
RECENT_STEPS = 20
"""The ETA uses the median step time of the last this many steps (the current attempt's pace)."""


class RunStatus(BaseModel):
    """One run, as `status`, `runs` and the Python API report it."""

    run_id: str
    run_dir: str
    target: str = "local"
    status: Status
    exit_code: int | None = None
    failure: dict | None = None
    """rank, phase, error_type, message and committed_step of the failure, when the run failed."""
    step: int | None = None
    max_steps: int | None = None
    last_loss: float | None = None
    val_loss: float | None = None
    tokens_per_s_per_device: float | None = None
    mfu: float | None = None
    cost_usd: float | None = None
    projected_cost_usd: float | None = None
    """Cost at `max_steps` at the recent pace (priced runs only)."""
    committed_step: int | None = None
    started: str | None = None
    """UTC ISO time the run was created."""
    elapsed_s: float | None = None
    """Wall time since the run was created, up to its end when it ended."""
    eta_s: float | None = None
    """Time left at the recent step time (live runs only)."""
    goodput: Goodput | None = None
    """Productive step time over wall time, and the badput buckets, across every attempt (`shardline.goodput`)."""
    liveness: str | None = None
    """For a live run on another host: `alive on <host> (last heartbeat 5s ago)` or `presumed dead on <host>
    (no heartbeat for 1h00m)`."""

    @computed_field
    @property
    def outcome(self) -> str:
        """The word `status`, `runs` and `wait` print for where the run is (`outcome_word`)."""
        return outcome_word(self.status)

    def progress_line(self) -> str:
        parts = [self.outcome]
        if self.step is not None and self.max_steps:
            parts.append(f"step {self.step}/{self.max_steps}")
        if self.elapsed_s is not None:
            parts.append(f"elapsed {format_duration(self.elapsed_s)}")
        if self.eta_s is not None:
            parts.append(f"ETA {format_duration(self.eta_s)}")
        if self.last_loss is not None:
            parts.append(f"loss {self.last_loss:.4f}")
        if self.cost_usd is not None:
            parts.append(f"cost ${self.cost_usd:.4g}")
        if self.projected_cost_usd is not None and self.status in LIVE:
            parts.append(f"projected ${self.projected_cost_usd:.4g} at step {self.max_steps}")
        if self.goodput is not None and self.goodput.wall_s > 0:
            parts.append(f"goodput {100 * self.goodput.ratio:.0f}%")
        return " · ".join(parts)


def outcome_word(status: str) -> str:
    """The one word for a run's status that every command prints: the engines' phase (engines/backend.py), so a
    local run and a cluster run that ended alike read alike; the manifest's `finished` is `succeeded`."""
    return {"finished": "succeeded"}.get(status, status)


def liveness(run_dir: Path, manifest: dict) -> str | None:
    """How a live run on another host was last heard from (its heartbeat's age); None for runs here or ended."""
    found = elsewhere(run_dir, manifest)
    if found is None:
        return None
    host, silent = found
    if silent <= HEARTBEAT_STALE_S:
        return f"alive on {host} (last heartbeat {format_duration(silent)} ago)"
    return f"presumed dead on {host} (no heartbeat for {format_duration(silent)})"


def eta_seconds(step_times: list[float], steps_left: int) -> float | None:
    """Steps left × the median recent step time (robust to one checkpoint or eval step)."""
    if not step_times or steps_left <= 0:
        return 0.0 if steps_left <= 0 else None
    return statistics.median(step_times[-RECENT_STEPS:]) * steps_left


# ---- processes -------------------------------------------------------------------------------------------
def process_entry(pid: int, role: str) -> dict:
    stat = proc_stat(pid)
    return {"pid": pid, "role": role, "host": socket.gethostname(), "start_ticks": stat[1] if stat else None}


def is_alive(entry: dict) -> bool | None:
    """True/False for a process recorded on this host (a reused pid or a zombie is not it); None when it ran
    on another host, where this machine cannot tell."""
    if entry.get("host") != socket.gethostname():
        return None
    pid = int(entry["pid"])
    if not Path("/proc/self/stat").is_file():  # no procfs: existence is all there is to ask
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    stat = proc_stat(pid)
    if stat is None or stat[0] == "Z":
        return False
    return entry.get("start_ticks") is None or stat[1] == entry["start_ticks"]


def record_process(run_dir: Path, pid: int, role: str) -> dict:
    """Add a process of the current attempt to the manifest (the launcher, torchrun); once per pid."""
    entry = process_entry(pid, role)
    with manifest_lock(run_dir):
        manifest = read_manifest(run_dir)
        known = [p for p in manifest.get("processes", []) if (p.get("pid"), p.get("host")) != (pid, entry["host"])]
        write_manifest(run_dir, manifest | {"processes": [*known, entry]})
    return entry


def live_processes(manifest: dict) -> list[dict]:
    return [p for p in manifest.get("processes", []) if is_alive(p)]


def refuse_if_running(run_dir: Path) -> None:
    """Refuse to launch a run again while a process of it lives on this host, or while it is heard from on
    another (`rundir.RunAliveElsewhere`): two trainings would share its checkpoints and metrics, and `cancel`
    could no longer reach the first."""
    if not (run_dir / "manifest.json").is_file():
        return
    refuse_if_alive_elsewhere(run_dir)
    manifest = read_manifest(run_dir)  # a run that already ended may keep its launcher a moment (the report)
    if manifest.get("status") in LIVE and (live := live_processes(manifest)):
        who = ", ".join(f"{p.get('role', 'process')} (pid {p['pid']})" for p in live)
        raise SpecError(str(run_dir), f"is still running: {who}",
                        f"wait for it (`shardline wait {run_dir}`) or stop it (`shardline cancel {run_dir}`), "
                        "then train it again to resume")


# ---- settling --------------------------------------------------------------------------------------------
def settle(run_dir: Path, exit_code: int | None = None, attempt: int | None = None) -> dict:
    """The manifest with a final status if the run has ended without one; returns the (updated) manifest.

    With `exit_code` (the launcher knows how its workers ended) a run still marked live is failed with it;
    without, only when every recorded process on this host is gone. With `attempt` (the launcher's own), only
    while that attempt is still the run's last: decided and written under the manifest lock, so a relaunch
    that started a new attempt meanwhile is never marked with the old one's verdict."""
    with manifest_lock(run_dir):
        return _settle_locked(run_dir, exit_code, attempt)


def _settle_locked(run_dir: Path, exit_code: int | None, attempt: int | None) -> dict:
    manifest = read_manifest(run_dir)
    if attempt is not None and len(manifest.get("attempts") or []) != attempt:
        return manifest  # another launch owns the run now
    if manifest.get("status") not in LIVE:
        return manifest
    processes = manifest.get("processes", [])
    if exit_code is None:
        alive = [is_alive(p) for p in processes]
        if not processes or any(a is not False for a in alive):
            return manifest  # nothing recorded here, or something may still run
    records = read_jsonl(run_dir / "metrics.jsonl")
    committed = _committed_step(records)
    attempt_start = epoch((manifest.get("attempts") or [{}])[-1].get("start_time")) or 0.0
    failures = read_failures(run_dir, since=attempt_start)
    if failures:
        message = failure_message(failures, {})
        first = failures[0]
        failure = {"message": message, "rank": first.rank, "phase": first.phase, "error_type": first.error_type,
                   "committed_step": first.committed_step}
    else:
        pids = ", ".join(f"{p['role']} pid {p['pid']}" for p in processes) or "no process recorded"
        how = (f"the workers exited with code {exit_code}" if exit_code is not None
               else f"its processes are gone ({pids} on {socket.gethostname()})")
        saved = (f"the last committed checkpoint is step {committed}" if committed is not None
                 else "no checkpoint was committed")
        failure = {"message": f"the run ended without recording an outcome: {how} (killed, or out of memory?); "
                              f"{saved}", "rank": None, "phase": None, "error_type": None,
                   "committed_step": committed}
    last_time = max((r.get("time", 0.0) for r in records), default=0.0)
    manifest |= {"status": "failed", "exit_code": exit_code, "failure": failure,
                 "end_time": time.time() if exit_code is not None else (last_time or time.time())}
    write_manifest(run_dir, manifest)
    return manifest


def mark_failed(run_dir: Path, message: str, exit_code: int, error_type: str | None = None,
                phase: str | None = None) -> None:
    """Record a failure the launcher itself saw (bad input found after the run was created, an interrupt)."""
    committed = _committed_step(read_jsonl(run_dir / "metrics.jsonl"))
    update_manifest(run_dir, status="failed", exit_code=exit_code, end_time=time.time(),
                    failure={"message": message, "rank": None, "phase": phase, "error_type": error_type,
                             "committed_step": committed})


def _committed_step(records: list[dict]) -> int | None:
    steps = [r["step"] for r in records if r.get("event") == "checkpoint_committed"]
    return max(steps) if steps else None


# ---- reading ---------------------------------------------------------------------------------------------
def read_status(run_dir: Path, target: str = "local") -> RunStatus:
    """The run's status (settled first), progress, ETA and cost from manifest.json and metrics.jsonl."""
    run_dir = Path(run_dir)
    manifest = settle(run_dir) if (run_dir / "manifest.json").is_file() else {}
    records = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval" and r.get("val_loss") is not None]
    last = train[-1] if train else {}
    spec = manifest.get("spec") or {}
    max_steps = (spec.get("train") or {}).get("max_steps")
    status = manifest.get("status", "unknown")
    started = epoch(manifest.get("start_time"))
    ended = epoch(manifest.get("end_time")) if status not in LIVE else None
    now = time.time()
    elapsed = ((ended or now) - started) if started else None
    step = last.get("step")
    eta = projected = None
    if status in LIVE and step is not None and max_steps:
        since = epoch((manifest.get("attempts") or [{}])[-1].get("start_time")) or 0.0
        recent = [r["step_time_s"] for r in train if r.get("time", 0.0) >= since] or [last["step_time_s"]]
        eta = eta_seconds(recent, max_steps - step)
        if last.get("cost_usd") is not None and step:
            projected = last["cost_usd"] / step * max_steps
    return RunStatus(
        run_id=manifest.get("run_id") or run_dir.name, run_dir=str(run_dir.resolve()), target=target,
        status=status if status in Status.__args__ else "unknown", exit_code=manifest.get("exit_code"),
        failure=manifest.get("failure") if status == "failed" else None, step=step, max_steps=max_steps,
        last_loss=last.get("loss"), val_loss=evals[-1]["val_loss"] if evals else None,
        tokens_per_s_per_device=last.get("tokens_per_s_per_device"), mfu=last.get("mfu"),
        cost_usd=last.get("cost_usd"), projected_cost_usd=projected, committed_step=_committed_step(records),
        started=datetime.fromtimestamp(started, UTC).isoformat(timespec="seconds") if started else None,
        elapsed_s=elapsed, eta_s=eta, goodput=compute_goodput(records, manifest, now if status in LIVE else None),
        liveness=liveness(run_dir, manifest))


def list_runs(directory: Path) -> list[RunStatus]:
    """Every run directory (one with manifest.json) under `directory`, newest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for run_dir in directory.iterdir():
        if (run_dir / "manifest.json").is_file():
            target = "local"
            launch = run_dir / "launch.json"
            if launch.is_file():
                with contextlib.suppress(ValueError):
                    target = json.loads(launch.read_text()).get("target", "local")
            found.append(read_status(run_dir, target))
    return sorted(found, key=lambda s: s.started or "", reverse=True)
