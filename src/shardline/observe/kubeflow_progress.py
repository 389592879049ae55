"""Live progress in the TrainJob (Kubeflow Trainer ≥ 2.2, feature gate TrainJobStatus): rank 0 posts progress %,
ETA and metrics through the Kubeflow SDK's own `update_trainjob_status`, so `kubectl get trainjob` and the SDK
show where a shardline run is.

The controller injects KUBEFLOW_TRAINER_SERVER_URL (its status endpoint for this TrainJob), ..._CA_CERT and
..._TOKEN (a projected service-account token of audience trainer.kubeflow.org); without the URL nothing is
sent. The SDK checks the token and CA, posts `{"trainerStatus": ...}` with a 5 s request timeout, never raises
and drops a post within 5 s of its last successful one.

Training never waits for the endpoint: a metrics record only updates the state and, when a post is due, puts it
in a one-report slot that a daemon thread posts (a newer report replaces one not yet sent; nothing queues up).
A post is attempted at the first step, then at most every POST_INTERVAL_S of attempts, failed ones included, and
once at close with the final state (100 % when the run finished), for which close waits at most FINAL_WAIT_S. The
first failure is logged, further ones not until a post succeeds again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shardline.goodput import compute_goodput
from shardline.jsonl import read_jsonl
from shardline.run_status import RECENT_STEPS, eta_seconds
from shardline.rundir import read_manifest

log = logging.getLogger("shardline")

SERVER_URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"
POST_INTERVAL_S = 30.0
SDK_THROTTLE_S = 5.0
"""kubeflow.trainer's update_trainjob_status drops a post sent within 5 s of its last successful one."""
FINAL_WAIT_S = 10.0
"""The longest close() waits for the final post: the SDK's throttle past the previous post, then one post."""

Post = Callable[..., bool]


def sdk_poster() -> Post | None:
    """The SDK's status utility, or None (logged) where the SDK is not installed (`pip install shardline[kubeflow]`)."""
    try:
        from kubeflow.trainer import update_trainjob_status
    except ImportError as e:
        log.warning("TrainJob progress not reported: the Kubeflow SDK is not installed (%s); "
                    "install shardline[kubeflow] in the image", e)
        return None
    return update_trainjob_status


def _text(value: float) -> str:
    return f"{value:.4g}"


@dataclass(frozen=True)
class _Report:
    percent: int
    eta_s: int | None
    metrics: dict[str, str]


class KubeflowProgressSink:
    """A metrics sink (fed every record rank 0 writes) that reports the newest train record's progress from a
    thread of its own; `close` makes the final report."""

    def __init__(self, post: Post, max_steps: int, world: int, run_dir: Path,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.post, self.max_steps, self.world, self.run_dir, self.clock = post, max_steps, world, run_dir, clock
        self.step = 0
        self.step_times: deque[float] = deque(maxlen=RECENT_STEPS)
        self.metrics: dict[str, str] = {}
        self.last_attempt: float | None = None  # on `clock`: when a post was last due or taken by the poster
        self._changed = threading.Condition()
        self._slot: _Report | None = None  # the report the poster sends next
        self._final: _Report | None = None
        self._failing = False
        self._last_success: float | None = None  # time.monotonic(), as the SDK's throttle
        self._poster = threading.Thread(target=self._run, name="shardline-trainjob-progress", daemon=True)
        self._poster.start()

    def __call__(self, kind: str, record: dict) -> None:
        if kind == "eval" and "val_loss" in record:
            self.metrics["eval_loss"] = _text(record["val_loss"])
        if kind != "train":
            return
        self.step = int(record["step"])
        self.step_times.append(float(record["step_time_s"]))
        self.metrics.update(loss=_text(record["loss"]),
                            tokens_per_s=_text(record["tokens_per_s_per_device"] * self.world),
                            mfu=_text(record["mfu"]), step=str(self.step), total_steps=str(self.max_steps))
        with self._changed:
            if self._final is not None:
                return
            now = self.clock()
            if self._slot is None and self.last_attempt is not None and now - self.last_attempt < POST_INTERVAL_S:
                return
            if self._slot is None:
                self.last_attempt = now
            self._slot = self._report(finished=False)
            self._changed.notify()

    def close(self, status: str) -> None:
        """The final report: 100 % when the run finished, else the progress reached. Sent past the SDK's throttle
        so that it is not dropped for coming too soon after the previous one; waits at most FINAL_WAIT_S."""
        with self._changed:
            if self._final is not None:
                return
            self._final, self._slot = self._report(finished=status == "finished"), None
            self._changed.notify()
        self._poster.join(FINAL_WAIT_S)
        if self._poster.is_alive():
            log.warning("final TrainJob status (progress %s%%) not confirmed within %.0f s; the run ends without it",
                        self._final.percent, FINAL_WAIT_S)

    def _report(self, finished: bool) -> _Report:
        eta = 0.0 if finished else eta_seconds(list(self.step_times), self.max_steps - self.step)
        percent = 100 if finished else min(99, int(100 * self.step / self.max_steps))
        return _Report(percent, None if eta is None else int(eta), dict(self.metrics))

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._slot is not None or self._final is not None)
                if self._final is not None:
                    break
                report, self._slot = self._slot, None
                self.last_attempt = self.clock()
            self._send(report)
        if self._last_success is not None:
            time.sleep(max(0.0, SDK_THROTTLE_S - (time.monotonic() - self._last_success)))
        self._send(self._final)

    def _goodput(self) -> dict[str, str]:
        try:
            goodput = compute_goodput(read_jsonl(self.run_dir / "metrics.jsonl"), read_manifest(self.run_dir),
                                      time.time())
        except Exception:  # noqa: BLE001 - a progress report never costs the run
            log.exception("goodput for the TrainJob status not computed")
            return {}
        return {} if goodput is None else {"goodput": _text(goodput.ratio)}

    def _send(self, report: _Report) -> bool:
        """Post one report; True when the controller took it. Only the first of a run of failures is logged."""
        error: Exception | None = None
        try:
            ok = bool(self.post(progress_percent=report.percent, estimated_remaining_seconds=report.eta_s,
                                metrics=report.metrics | self._goodput()))
        except Exception as e:  # noqa: BLE001 - the SDK promises not to raise; a report never costs the run anyway
            ok, error = False, e
        if ok:
            self._last_success = time.monotonic()
            if self._failing:
                log.info("TrainJob status updated again (progress %s%%)", report.percent)
            self._failing = False
        elif not self._failing:
            self._failing = True
            log.warning("TrainJob status not updated (progress %s%%); training goes on, and further failures are not "
                        "logged until a post succeeds", report.percent, exc_info=error)
        return ok
