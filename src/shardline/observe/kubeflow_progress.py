"""Live progress in the TrainJob (Kubeflow Trainer ≥ 2.2, feature gate TrainJobStatus): rank 0 posts progress %,
ETA and metrics through the Kubeflow SDK's own `update_trainjob_status`, so `kubectl get trainjob` and the SDK
show where a shardline run is.

The controller injects KUBEFLOW_TRAINER_SERVER_URL (its status endpoint for this TrainJob), ..._CA_CERT and
..._TOKEN (a projected service-account token of audience trainer.kubeflow.org); without the URL nothing is
sent. The SDK checks the token and CA, posts `{"trainerStatus": ...}`, never raises and drops a post within 5 s
of the last; shardline posts at most every POST_INTERVAL_S and once at the end, with 100 % when the run finished.
A failed post is logged; training never waits for one beyond the final post's retry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from shardline.goodput import compute_goodput
from shardline.jsonl import read_jsonl
from shardline.run_status import eta_seconds
from shardline.rundir import read_manifest

log = logging.getLogger("shardline")

SERVER_URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"
POST_INTERVAL_S = 30.0
SDK_THROTTLE_S = 5.0
"""kubeflow.trainer's update_trainjob_status drops a post sent within 5 s of its last successful one."""

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


class KubeflowProgressSink:
    """A metrics sink (fed every record rank 0 writes) that reports the newest train record's progress."""

    def __init__(self, post: Post, max_steps: int, world: int, run_dir: Path,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.post, self.max_steps, self.world, self.run_dir, self.clock = post, max_steps, world, run_dir, clock
        self.step = 0
        self.step_times: list[float] = []
        self.metrics: dict[str, str] = {}
        self.last_post: float | None = None

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
        if self.last_post is None or self.clock() - self.last_post >= POST_INTERVAL_S:
            self.send()

    def _goodput(self) -> None:
        try:
            goodput = compute_goodput(read_jsonl(self.run_dir / "metrics.jsonl"), read_manifest(self.run_dir),
                                      time.time())
        except Exception:  # noqa: BLE001 - a progress report never costs the run
            log.exception("goodput for the TrainJob status not computed")
            return
        if goodput is not None:
            self.metrics["goodput"] = _text(goodput.ratio)

    def send(self, finished: bool = False) -> bool:
        """Post progress, ETA and metrics; True when the controller took it."""
        self._goodput()
        left = self.max_steps - self.step
        eta = 0.0 if finished else eta_seconds(self.step_times, left)
        percent = 100 if finished else min(99, int(100 * self.step / self.max_steps))
        try:
            ok = bool(self.post(progress_percent=percent,
                                estimated_remaining_seconds=None if eta is None else int(eta),
                                metrics=dict(self.metrics)))
        except Exception:  # noqa: BLE001 - the SDK promises not to raise; a report never costs the run anyway
            log.exception("TrainJob status post failed")
            ok = False
        if ok:
            self.last_post = self.clock()
        else:
            log.warning("TrainJob status not updated (progress %s%%)", percent)
        return ok

    def close(self, status: str) -> None:
        """The final post: 100 % when the run finished, else the progress reached. Retried once past the SDK's
        throttle, so the last word is never dropped for coming too soon after the one before."""
        finished = status == "finished"
        if self.last_post is not None:
            time.sleep(max(0.0, SDK_THROTTLE_S - (self.clock() - self.last_post)))
        if not self.send(finished):
            time.sleep(SDK_THROTTLE_S)
            self.send(finished)
