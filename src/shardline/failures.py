"""What a failed worker leaves behind, and the one message a person reads about it.

A worker that raises writes `logs/failure-rank-<r>.json` (rank, exception, the phase it was in, the last
committed checkpoint) and its traceback to `logs/rank-<r>.log`, then exits. The launcher side
(`shardline.engines.torchrun`, on every engine) turns the records of one attempt, plus torchrun's view of ranks
that died without a record (a signal, the OOM killer), into a single message instead of torchrun's dump.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

FAILURE_PREFIX = "failure-rank-"
REPORTER_ENV = "SHARDLINE_FAILURES_REPORTED"
"""Set by `shardline.engines.torchrun` for its workers; a worker started any other way prints its own error."""
PHASES = {
    "setup": "setting up (process group, data, model build/load)",
    "training": "training",
    "validation": "validating",
    "checkpoint": "saving a checkpoint",
    "sql_evaluation": "running the final SQL evaluation",
    "evaluation": "evaluating the checkpoint",
}

HANG_ERROR = "HangDetected"
"""`error_type` of the record the hang watchdog (resilience/watchdog.py) writes for a rank that stopped arriving."""

# How a collective reports that another rank is gone (gloo, NCCL): a consequence, not a cause.
PEER_LOST = re.compile(r"closed by peer|reset by peer|remote process exited|communicator was aborted|"
                       r"Broken pipe|Connection refused", re.IGNORECASE)


@dataclass(frozen=True)
class WorkerFailure:
    rank: int
    host: str
    error_type: str
    message: str
    phase: str
    step: int | None
    """The last completed optimizer step when the failure happened (None before the model existed)."""
    max_steps: int
    committed_step: int | None
    """The newest committed checkpoint at that moment: what a resume starts from."""
    checkpoint: str | None
    log: str
    time: float
    exit_code: int | None = None
    """The code the worker exits with (2 bad input, 1 other): the run's, however torchrun saw it end (a rank
    SIGTERMed after a peer failed first reads 143)."""


def failure_path(run_dir: Path, rank: int) -> Path:
    return run_dir / "logs" / f"{FAILURE_PREFIX}{rank}.json"


def write_failure(run_dir: Path, failure: WorkerFailure) -> Path:
    """Write the record atomically (a reader never sees half of it)."""
    path = failure_path(run_dir, failure.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(asdict(failure), indent=2) + "\n")
    os.replace(tmp, path)
    return path


def read_failures(run_dir: Path, since: float = 0.0) -> list[WorkerFailure]:
    """The failure records written at or after `since` (epoch seconds): one attempt's, not an earlier one's."""
    found = []
    for path in sorted((run_dir / "logs").glob(f"{FAILURE_PREFIX}*.json")):
        try:
            failure = WorkerFailure(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if failure.time >= since:
            found.append(failure)
    return sorted(found, key=lambda f: (f.time, f.rank))


def _exit_words(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (the kernel's OOM killer sends this when memory runs out)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {code} without a failure record"


def failure_message(failures: list[WorkerFailure], unexplained: dict[int, int]) -> str:
    """One message: which ranks failed, in what, with what error; where the traceback is; what is safe.

    `unexplained` maps ranks that died without a record (per torchrun) to their exit code (negative: signal).
    """
    lines = []
    causes = [f for f in failures if not PEER_LOST.search(f.message)] or failures
    followers = sorted(f.rank for f in failures if f not in causes)
    if causes:
        first = causes[0]
        same = defaultdict(list)
        for f in causes:
            same[(f.error_type, f.message)].append(f.rank)
        ranks = same[(first.error_type, first.message)]
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        finished = first.step is not None and first.step >= first.max_steps
        if first.phase == "sql_evaluation" or (finished and first.phase == "validation"):
            lines.append(f"training finished (step {first.step} of {first.max_steps}), then {who} failed while "
                         f"{PHASES[first.phase]}: {first.error_type}: {first.message}")
        else:
            at = "" if first.step is None else (f" in step {first.step + 1} of {first.max_steps}"
                                                if first.phase == "training" else f" after step {first.step}")
            lines.append(f"{who} failed while {PHASES.get(first.phase, first.phase)}{at}: "
                         f"{first.error_type}: {first.message}")
        for (error_type, message), others in same.items():
            if (error_type, message) != (first.error_type, first.message):
                lines.append(f"  also rank {', '.join(map(str, others))}: {error_type}: {message}")
        if followers:
            lines.append(f"  rank {', '.join(map(str, followers))} then stopped: a collective lost its peer")
        lines.append(f"  traceback: {first.log}")
    for rank, code in sorted(unexplained.items()):
        lines.append(f"{'  also ' if lines else ''}rank {rank} {_exit_words(code)}")
    committed = next((f for f in failures if f.committed_step is not None), None)
    if committed is not None:
        lines.append(f"  the last checkpoint is safe: step {committed.committed_step} at {committed.checkpoint} "
                     "(`shardline train RUN_DIR` resumes from it)")
    elif failures:
        lines.append("  no checkpoint was committed in this run yet")
    return "\n".join(lines)
