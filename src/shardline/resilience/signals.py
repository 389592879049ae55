"""Preemption: SIGTERM / SIGUSR1 / SIGINT set a flag; ranks agree at the next step boundary, or after the current
batch of a validation or generation (which is then abandoned), and checkpoint the step unless it is committed.

torchrun forwards these signals to every worker (`--signals-to-handle`) and waits
`launch.grace_seconds` before SIGKILL; Kubernetes sends SIGTERM on pod deletion or node drain, Slurm
sends SIGUSR1 `--signal=B:USR1@<grace>` before the time limit or a preemption.
"""

from __future__ import annotations

import signal
import threading
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # SIGINT: Ctrl-C reaches every process of the group


class StopRequest:
    """Records the first stop signal; handlers only set fields (async-signal safe)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.received_at: float | None = None

    def install(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            return self  # Ray Train runs the loop in a worker thread; Ray itself handles worker failures
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum, self.received_at = signum, time.monotonic()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""


class Preempted(Exception):
    """Raised after the preemption checkpoint committed; the worker exits with EXIT_PREEMPTED."""


class EvaluationStopped(Exception):
    """Raised on every rank inside validation or generation once the ranks agreed to stop: the evaluation is
    abandoned (it writes no score); the trainer then checkpoints the step if needed and raises Preempted."""

    def __init__(self, phase: str) -> None:
        super().__init__(f"stopped during {phase}")
        self.phase = phase
