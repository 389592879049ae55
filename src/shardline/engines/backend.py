"""What every cluster launcher provides, and the verbs built on it (render, launch, status, logs, wait, cancel).

A backend turns the resolved spec into its engine's objects (render), hands them to the engine (submit),
and reads the engine's state back (status, logs, cancel). `wait` is the same loop for every engine.
The record of a submission lives next to the run locally: `<run.dir>/<run_id>/launch.json`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel

from shardline.errors import EXIT_FAILURE, EXIT_OK, EXIT_PREEMPTED, SpecError
from shardline.spec import JobSpec

EXIT_TIMEOUT = 124
Phase = Literal["queued", "starting", "running", "succeeded", "failed", "preempted", "unknown"]
TERMINAL: tuple[Phase, ...] = ("succeeded", "failed", "preempted")
EXIT_BY_PHASE = {"succeeded": EXIT_OK, "failed": EXIT_FAILURE, "preempted": EXIT_PREEMPTED}


class LaunchRecord(BaseModel):
    """Where a submitted run lives in its engine; enough for status/logs/wait/cancel to find it again."""

    target: str
    run_id: str
    submitted_at: str
    namespace: str | None = None
    context: str | None = None
    """Kubernetes context (None: the kubeconfig's current context)."""
    objects: list[dict[str, str]] = []
    """Kubernetes objects created: apiVersion, kind, name."""
    nnodes: int = 1
    job_id: str | None = None
    """Engine job id (Slurm job id, Ray submission id, the local launcher's pid)."""
    run_dir: str | None = None
    """The run directory on this machine: where this record was found (a cluster run's metrics may live in
    its bucket instead)."""


class RankState(BaseModel):
    rank: int
    name: str
    """Pod, host or actor name."""
    state: str
    restarts: int = 0
    detail: str = ""


class JobState(BaseModel):
    phase: Phase
    reasons: list[str] = []
    """Why the job is where it is, in plain words (queue, capacity, scheduling, image, exit codes)."""
    ranks: list[RankState] = []
    restarts: int = 0


class Backend(Protocol):
    target: str

    def render(self, spec: JobSpec, task: str = "train") -> dict[str, str]:
        """File name → content of everything this engine needs (manifests, batch script)."""

    def submit(self, spec: JobSpec, task: str = "train") -> LaunchRecord: ...

    def status(self, record: LaunchRecord) -> JobState: ...

    def logs(self, record: LaunchRecord, rank: int | None, follow: bool) -> Iterator[str]:
        """Lines prefixed with `[rank k]`; with follow, waits for the job to start and streams until it ends."""

    def cancel(self, record: LaunchRecord) -> None: ...


def record_path(run_dir: Path) -> Path:
    return run_dir / "launch.json"


def save_record(run_dir: Path, record: LaunchRecord) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = record_path(run_dir)
    path.write_text(record.model_dump_json(indent=2))
    return path


def load_record(run: str, runs_dir: str = "runs") -> LaunchRecord:
    """A run directory, or a run id under `runs_dir`. A run directory without a launch record (a run trained
    before records existed, or copied from elsewhere) is a local run."""
    candidates = [Path(run), Path(runs_dir) / run]
    for c in candidates:
        if record_path(c).is_file():
            record = LaunchRecord.model_validate(json.loads(record_path(c).read_text()))
            record.run_dir = str(c.resolve())  # the directory given is the run, wherever it was moved
            return record
    for c in candidates:
        if (c / "manifest.json").is_file():
            return LaunchRecord(target="local", run_id=c.resolve().name, submitted_at="", run_dir=str(c.resolve()))
    raise SpecError(run, "is neither a run directory nor a run id under " + runs_dir,
                    "pass the run directory or run id printed by `shardline train` or `shardline launch`")


def wait_for(backend: Backend, record: LaunchRecord, timeout_s: float | None, poll_s: float = 5.0,
             on_change: Callable[[JobState], None] | None = None) -> int:
    """Poll until the job ends: 0 succeeded, 1 failed, 75 preempted, 124 timed out (docs/architecture.md §7)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    last: tuple | None = None
    while True:
        state = backend.status(record)
        key = (state.phase, tuple(state.reasons), tuple((r.rank, r.state, r.restarts) for r in state.ranks))
        if on_change is not None and key != last:
            on_change(state)
        last = key
        if state.phase in TERMINAL:
            return EXIT_BY_PHASE[state.phase]
        if deadline is not None and time.monotonic() >= deadline:
            return EXIT_TIMEOUT
        time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))
