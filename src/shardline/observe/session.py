"""Everything that watches a training run from rank 0, set up and torn down around `Trainer.fit`.

Observability must never make a run fail: a port that is taken, a tracker that raises or a report that
cannot be drawn is logged and printed, and training goes on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from shardline.failures import REPORTER_ENV
from shardline.jsonl import read_jsonl
from shardline.observe.kubeflow_progress import SERVER_URL_ENV
from shardline.planning.cost import CostMeter, previous_cost_usd, process_started_monotonic, resolve_price
from shardline.rundir import read_manifest, update_manifest
from shardline.spec.resolve import spec_hash

if TYPE_CHECKING:
    from rich.console import Console

    from shardline.spec import JobSpec
    from shardline.training.trainer import Trainer

log = logging.getLogger("shardline")

LOCAL_METRICS_HOST = "127.0.0.1"  # observe.metrics_host unset on a local run: this machine only


def device_name(trainer: Trainer) -> str:
    import torch

    device = trainer.ctx.device
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def count_resumes(metrics_file: Path) -> int:
    if not metrics_file.is_file():
        return 0
    with metrics_file.open() as f:
        return sum(1 for line in f if '"event": "resume"' in line)


def past_hangs(metrics_file: Path) -> list[dict]:
    """Earlier attempts' `hang` events (resilience/watchdog.py): their reporting process exited at once."""
    return [r for r in read_jsonl(metrics_file) if r.get("event") == "hang"]


class ObserveSession:
    def __init__(self, spec: JobSpec, run_dir: Path, trainer: Trainer, console: Console) -> None:
        self.spec, self.run_dir, self.console = spec, run_dir, console
        self.closers: list = []
        self.prometheus = None
        self.progress = None
        self.linger_s = 0.0
        writer = trainer.metrics
        metrics_file = run_dir / "metrics.jsonl"
        device = device_name(trainer)
        price = resolve_price(spec, device)
        writer.cost = CostMeter(price, trainer.ctx.world, previous_cost_usd(metrics_file),
                                started=process_started_monotonic())
        self._say(writer.cost.describe())
        o = spec.observe
        if o.metrics_port is not None:
            self._start_prometheus(writer, device, price.usd_per_device_hour, count_resumes(metrics_file))
        if o.tensorboard:
            self._add_tracker(writer, "TensorBoard", lambda: _tensorboard(run_dir))
        if o.wandb_project:
            self._add_tracker(writer, "W&B", lambda: _wandb(spec, run_dir))
        if os.environ.get(SERVER_URL_ENV):  # a TrainJob whose controller takes status (Trainer's TrainJobStatus)
            self._start_progress(writer, spec, run_dir, trainer.ctx.world)

    def _say(self, message: str) -> None:
        log.info(message)
        self.console.print(message, highlight=False, markup=False)

    def _start_prometheus(self, writer, device: str, usd_per_hour: float | None, resumes: int) -> None:
        from shardline.observe.prometheus import PrometheusSink, serve

        o, spec = self.spec.observe, self.spec
        info = {"run_name": spec.run.name, "spec_hash": spec_hash(spec)[:12], "device": device,
                "world_size": str(spec.world_size), "provisioning": spec.cost.provisioning}
        sink = PrometheusSink(spec.run.id or spec.run.name, info, previous_resumes=resumes,
                              max_steps=spec.train.max_steps)
        sink.set_price(usd_per_hour)
        for hang in past_hangs(self.run_dir / "metrics.jsonl"):
            sink.hang(hang)
        try:
            endpoint, stop = serve(sink, o.metrics_host or LOCAL_METRICS_HOST, o.metrics_port)
        except OSError as e:
            self._say(f"warning: metrics endpoint not started ({o.metrics_host}:{o.metrics_port}: {e.strerror or e}); "
                      "training continues — choose another observe.metrics_port (0 = any free port)")
            update_manifest(self.run_dir, metrics_url=None, metrics_error=str(e))
            return
        self.prometheus, self.linger_s = sink, o.metrics_linger_s
        writer.sinks.append(sink)
        self.closers.append(stop)
        update_manifest(self.run_dir, metrics_url=endpoint.url)
        self._say(f"metrics: {endpoint.url} (Prometheus, rank 0)")

    def _start_progress(self, writer, spec: JobSpec, run_dir: Path, world: int) -> None:
        from shardline.observe.kubeflow_progress import KubeflowProgressSink, sdk_poster

        if (post := sdk_poster()) is None:
            self._say("warning: TrainJob progress not reported: the Kubeflow SDK is not installed")
            return
        self.progress = KubeflowProgressSink(post, spec.train.max_steps, world, run_dir)
        writer.sinks.append(self.progress)
        self._say("TrainJob progress: reported to the Kubeflow Trainer controller (rank 0)")

    def _add_tracker(self, writer, name: str, make) -> None:
        try:
            sink = make()
        except Exception as e:  # a tracker that cannot start must not stop training
            log.exception("%s logging not started", name)
            self._say(f"warning: {name} logging not started: {e}")
            return
        writer.sinks.append(sink)
        self.closers.insert(0, sink.close)
        self._say(f"{name} logging on")

    def close(self, status: str) -> None:
        """Record the final status, write the report, keep serving `metrics_linger_s`, then stop everything."""
        import time

        if self.prometheus is not None:
            self.prometheus.set_status(status)
        if self.progress is not None:
            try:
                self.progress.close(status)
            except Exception:  # noqa: BLE001 - the last progress report never costs the run
                log.exception("final TrainJob status not reported")
        if self.spec.observe.report and not (status == "failed" and os.environ.get(REPORTER_ENV)):
            from shardline.observe.report import write_report_safely  # after a failure the launcher writes it

            write_report_safely(self.run_dir, self._say)
        if self.prometheus is not None and self.linger_s:
            time.sleep(self.linger_s)
        for close in self.closers:
            try:
                close()
            except Exception:
                log.exception("closing an observer failed")


def _tensorboard(run_dir: Path):
    from shardline.observe.trackers import TensorBoardSink

    return TensorBoardSink(run_dir / "tensorboard")


def _wandb(spec: JobSpec, run_dir: Path):
    from shardline.observe.trackers import WandbSink

    return WandbSink(spec, run_dir)


@contextmanager
def observing(spec: JobSpec, run_dir: Path, trainer: Trainer, console: Console) -> Iterator[None]:
    """Around `fit()` on rank 0 (a no-op elsewhere): cost meter, metrics endpoint, trackers, and at the end
    the final status and the report. The status is `finished`, `preempted` (exit 75) or `failed`."""
    if not trainer.ctx.is_main:
        yield
        return
    from shardline.resilience.signals import Preempted

    try:
        session = ObserveSession(spec, run_dir, trainer, console)
    except Exception as e:  # a bug in observing must not cost the run
        log.exception("observability not started")
        console.print(f"warning: metrics, cost and report are off for this run: {e}", highlight=False, markup=False)
        yield
        return
    status = "failed"
    try:
        yield
        status = read_manifest(run_dir).get("status") or "finished"  # the worker sets finished / preempted
    except Preempted:
        status = "preempted"
        raise
    finally:
        session.close(status)
