"""The Prometheus endpoint of a training run: rank 0 serves `/metrics` on `observe.metrics_port`.

Why rank 0, aggregated, rather than every rank: every value of a step record is already global — the
loss, token counts and grad norm are all-reduced, tokens/s and TFLOP/s are per-device means of the whole
world — so W endpoints would export W copies of the same numbers, need W ports per node and W scrape
targets per job. What does differ per device (utilisation, memory, temperature, NVLink/NCCL traffic) is
exported per GPU by NVIDIA's DCGM exporter, which the dashboard and alerts use next to these series.
`shardline_mem_peak_bytes` is rank 0's peak (FSDP ranks hold equal shards, to the remainder of a split).

Names derive from the metrics-record fields (docs/architecture.md §5): `shardline_<field>`, with a trailing `_s`
spelled `_seconds` (Prometheus base units), for the value of the latest step. Running sums are counters
named `shardline_train_<field>_total` (tokens, steps, step and data-wait time, checkpoint stall), so that
`rate()` gives exact averages between scrapes however many steps fall between two of them; checkpoints,
resumes and preemptions count as `shardline_<event>s_total`. Every series carries the label `run_id`.
Goodput (`shardline.goodput`) is `shardline_goodput_ratio` plus `shardline_badput_seconds{bucket=...}`, updated at
each checkpoint and at the end of each attempt.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Info, start_http_server

from shardline.goodput import BADPUT

log = logging.getLogger("shardline")

PREFIX = "shardline_"
METRICS_PORT_NAME = "metrics"
"""Name of the trainer container's `/metrics` port; the PodMonitoring scrapes it by this name."""
# `evaluating`: the last step is done and the final evaluation runs (long on big models, and no records
# until it ends: the no-progress alert only watches `running`).
STATUSES = ("starting", "running", "evaluating", "finished", "preempted", "failed")


def metric_name(field: str) -> str:
    """`step_time_s` → `shardline_step_time_seconds`: the one naming rule from record field to series."""
    return PREFIX + (field[:-2] + "_seconds" if field.endswith("_s") else field)


# Step-record fields exported as gauges (the value of the latest step); docs/architecture.md §5 plus cost.
TRAIN_GAUGES: dict[str, str] = {
    "step": "Optimizer steps completed.",
    "loss": "Training loss of the latest step (global token-weighted mean).",
    "lr": "Learning rate used by the latest step.",
    "grad_norm": "Global gradient norm of the latest step, before clipping.",
    "step_time_s": "Wall time of the latest step.",
    "data_wait_s": "Time the latest step waited for its batches.",
    "tokens_per_s_per_device": "Non-padding tokens per second per device in the latest step.",
    "loss_tokens_per_s_per_device": "Loss-bearing tokens per second per device in the latest step.",
    "tflops_per_device": "Achieved model TFLOP/s per device in the latest step.",
    "mfu": "Model FLOPs utilisation of the latest step (0-1): document-masked attention, no causal halving.",
    "hfu": "Hardware FLOPs utilisation of the latest step (0-1): padding, attention as computed, recompute.",
    "mem_peak_bytes": "Peak memory of rank 0 so far (CUDA max allocated; CPU peak RSS).",
    "epoch": "Epochs of the training set consumed.",
    "cost_usd": "Run cost so far in US dollars (all devices, wall time, earlier attempts included).",
    "cost_usd_step": "US dollars of device time the latest step took.",
    "cost_usd_per_1m_tokens": "US dollars per million non-padding tokens at the latest step's speed.",
}
# Step-record fields summed into counters: field → (counter name without `_total`, help).
TRAIN_COUNTERS: dict[str, tuple[str, str]] = {
    "tokens_total": ("shardline_train_tokens", "Non-padding tokens trained."),
    "tokens": ("shardline_train_loss_tokens", "Loss-bearing tokens trained."),
    "step_time_s": ("shardline_train_step_seconds", "Summed step wall time (÷ steps = mean step time)."),
    "data_wait_s": ("shardline_train_data_wait_seconds", "Summed data-wait time of the steps."),
}
# DPO's means (`shardline_dpo_<field>{split="train"|"validation"}`): the latest step's pairs, the held-out pairs.
PREFERENCE_GAUGES: dict[str, str] = {
    "loss": "DPO loss (with train.dpo.sft_weight's term).",
    "accuracy": "Share of pairs whose chosen reward exceeds the rejected one's (0-1).",
    "margin": "Mean chosen minus rejected reward (β·log-ratio).",
    "prefers_chosen": "Share of pairs whose chosen completion the model finds more likely (0-1).",
}

GRPO_GAUGES: dict[str, str] = {
    "reward": "GRPO: mean reward of the latest step's sampled completions.",
    "solved": "GRPO: share of the latest step's completions the task's check passed (0-1), where it has one.",
    "zero_std": "GRPO: share of the latest step's completions whose group's rewards were all equal (no signal).",
    "sampled_zero_std": "GRPO: share of the latest step's sampled completions whose group had no reward spread, "
                        "before train.grpo.oversample kept the groups that spread most.",
    "completion_length": "GRPO: mean tokens per sampled completion in the latest step.",
    "truncated": "GRPO: share of the latest step's completions cut at train.grpo.max_new_tokens.",
    "kl": "GRPO: mean per-token KL to the reference in the latest step (0 with train.grpo.beta=0).",
    "generation_s": "GRPO: seconds the latest step spent sampling completions.",
    "reward_s": "GRPO: seconds the latest step spent scoring completions.",
}

EVAL_GAUGES: dict[str, str] = {
    "val_loss": "Validation loss at the latest evaluation.",
    "sql_execution_accuracy": "SQL test-suite execution accuracy on the distinct test questions (0-1).",
    "sql_exact_match": "SQL exact match (normalised text) on the distinct test questions (0-1).",
}


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @property
    def url(self) -> str:
        host = socket.gethostname() if self.host in ("0.0.0.0", "") else self.host  # all interfaces: this host
        return f"http://{host}:{self.port}/metrics"


class PrometheusSink:
    """Turns metrics records (kind train/eval/checkpoint/event) into series; call it with each record."""

    def __init__(self, run_id: str, info: dict[str, str], previous_resumes: int = 0,
                 max_steps: int | None = None) -> None:
        self.registry = CollectorRegistry()
        self.run_id, self.max_steps = run_id, max_steps
        labels = ["run_id"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry)

        self.train_gauges = {f: gauge(metric_name(f), doc) for f, doc in TRAIN_GAUGES.items()}
        self.preference = {f: Gauge(PREFIX + "dpo_" + f, doc, [*labels, "split"], registry=self.registry)
                           for f, doc in PREFERENCE_GAUGES.items()}
        self.grpo = {f: gauge(PREFIX + "grpo_" + f, doc) for f, doc in GRPO_GAUGES.items()}
        self.train_counters = {f: counter(name, doc) for f, (name, doc) in TRAIN_COUNTERS.items()}
        self.eval_gauges = {f: gauge(metric_name(f), doc) for f, doc in EVAL_GAUGES.items()}
        self.steps = counter("shardline_train_steps", "Optimizer steps completed by this worker process.")
        self.last_step_time = gauge("shardline_last_step_timestamp_seconds", "Unix time the latest step ended.")
        self.last_progress = gauge("shardline_last_progress_timestamp_seconds",
                                   "Unix time of the latest record (step, evaluation, checkpoint).")
        self.ckpt_save = gauge(metric_name("checkpoint_save_s"), "Seconds the latest checkpoint took to commit.")
        self.ckpt_stall = gauge(metric_name("checkpoint_stall_s"), "Seconds the latest checkpoint stalled training.")
        self.ckpt_stall_total = counter("shardline_train_checkpoint_stall_seconds",
                                        "Training time stalled by checkpoints.")
        self.ckpts = counter("shardline_checkpoints", "Checkpoints committed.")
        self.ckpt_step = gauge("shardline_checkpoint_last_step", "Step of the latest committed checkpoint.")
        self.ckpt_time = gauge("shardline_checkpoint_last_timestamp_seconds", "Unix time of the latest commit.")
        self.resumes = counter("shardline_resumes", "Resumes from a checkpoint over the run's lifetime.")
        self.preemptions = counter("shardline_preemptions", "Stops on a signal with a checkpoint (exit 75).")
        self.hangs = counter("shardline_hangs", "Hangs the watchdog reported over the run's lifetime (exit 76).")
        self.last_hang = gauge("shardline_last_hang_timestamp_seconds", "Unix time of the latest hang report; the "
                               "named ranks are in metrics.jsonl (event hang) and the manifest's hangs.")
        self.restarts = gauge("shardline_restarts", "Worker-group restarts by torchrun in this launch "
                              "(TORCHELASTIC_RESTART_COUNT).")
        self.started = gauge("shardline_worker_start_time_seconds", "Unix time this rank-0 worker started; "
                             "changes(...) counts restarts.")
        self.peak = gauge("shardline_peak_tflops", "Per-device peak TFLOP/s used as the MFU denominator.")
        self.world = gauge("shardline_world_size", "Ranks (devices) in the job.")
        self.price = gauge("shardline_usd_per_device_hour", "Price of one device-hour used for cost.")
        self.goodput = gauge("shardline_goodput_ratio", "Productive step time over wall time, every attempt of the "
                             "run (shardline.goodput), at the latest checkpoint or end.")
        self.badput = Gauge("shardline_badput_seconds", "Wall time of the run not spent in productive steps, by "
                            "bucket (startup, data_wait, checkpoint_save, wasted, restart_gap, ...).",
                            ["run_id", "bucket"], registry=self.registry)
        self.status = Enum("shardline_run_status", "Run state.", labels, states=list(STATUSES),
                           registry=self.registry)
        self.info = Info("shardline_run", "Run identity.", labels, registry=self.registry)

        self.info.labels(run_id).info(info)
        self.status.labels(run_id).state("starting")
        self.resumes.labels(run_id).inc(previous_resumes)
        self.restarts.labels(run_id).set(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
        self.started.labels(run_id).set(time.time())
        for c in (*self.train_counters.values(), self.steps, self.ckpts, self.ckpt_stall_total, self.preemptions):
            c.labels(run_id)  # present at 0 from the first scrape, so increase() sees the first step

    def set_price(self, usd_per_device_hour: float | None) -> None:
        if usd_per_device_hour is not None:
            self.price.labels(self.run_id).set(usd_per_device_hour)

    def hang(self, record: dict) -> None:
        """A `hang` event, live or replayed from an earlier attempt's records (the reporting process exits at
        once, so a restarted worker re-exports its predecessors' hangs)."""
        self.hangs.labels(self.run_id).inc()
        self.last_hang.labels(self.run_id).set(record.get("time") or time.time())

    def set_status(self, status: str) -> None:
        self.status.labels(self.run_id).state(status)

    def __call__(self, kind: str, record: dict) -> None:
        rid = self.run_id
        now = record.get("time") or time.time()
        self.last_progress.labels(rid).set(now)
        if kind == "train":
            last = self.max_steps is not None and record.get("step", 0) >= self.max_steps
            self.status.labels(rid).state("evaluating" if last else "running")
            for field, g in self.train_gauges.items():
                if record.get(field) is not None:
                    g.labels(rid).set(record[field])
            for field, c in self.train_counters.items():
                if record.get(field) is not None:
                    c.labels(rid).inc(max(0.0, float(record[field])))
            self._preference(record.get("preference"), "train")
            for field, g in self.grpo.items():
                if (record.get("grpo") or {}).get(field) is not None:
                    g.labels(rid).set(record["grpo"][field])
            self.steps.labels(rid).inc()
            self.last_step_time.labels(rid).set(now)
        elif kind == "eval":
            for field, g in self.eval_gauges.items():
                if record.get(field) is not None:
                    g.labels(rid).set(record[field])
            self._preference(record.get("val_preference"), "validation")
        else:
            self._event(record.get("event", kind), record)

    def _preference(self, found: dict | None, split: str) -> None:
        """DPO's latest means (`train.objective: dpo`), on the step's pairs or the held-out pairs."""
        for field, g in self.preference.items():
            if found and found.get(field) is not None:
                g.labels(self.run_id, split).set(found[field])

    def _event(self, event: str, record: dict) -> None:
        rid = self.run_id
        if event == "checkpoint" and record.get("stall_s") is not None:
            self.ckpt_stall.labels(rid).set(record["stall_s"])
            self.ckpt_stall_total.labels(rid).inc(record["stall_s"])
        elif event == "checkpoint_committed":
            self.ckpt_save.labels(rid).set(record["save_s"])
            self.ckpts.labels(rid).inc()
            self.ckpt_step.labels(rid).set(record["step"])
            self.ckpt_time.labels(rid).set(record.get("time") or time.time())
        elif event == "resume":
            self.resumes.labels(rid).inc()
        elif event == "preempted":
            self.preemptions.labels(rid).inc()
        elif event == "hang":
            self.hang(record)
        elif event == "goodput":
            self.goodput.labels(rid).set(record["ratio"])
            for bucket in BADPUT:
                self.badput.labels(rid, bucket).set(record["buckets"].get(bucket, 0.0))
        elif event == "setup":
            self.peak.labels(rid).set(record["peak_tflops"])
            self.world.labels(rid).set(record["world"])


def serve(sink: PrometheusSink, host: str, port: int) -> tuple[Endpoint, Callable[[], None]]:
    """Serve the sink's registry over HTTP; returns the endpoint (the real port when `port` is 0) and a stop
    function. Raises OSError when the port is taken."""
    server, thread = start_http_server(port, addr=host, registry=sink.registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return Endpoint(host, server.server_port), stop


def scrape_annotations(port: int) -> dict[str, str]:
    """Pod annotations for annotation-based Prometheus discovery (`prometheus.io/*`): for the rank-0 pod."""
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def pod_monitoring(namespace: str, port: str = METRICS_PORT_NAME, interval_s: int = 15) -> dict:
    """A Google Cloud Managed Service for Prometheus `PodMonitoring` (monitoring.googleapis.com/v1) that scrapes
    `/metrics` of every shardline job's rank-0 pod in `namespace`, through the container port named `port`.

    One per namespace, not one per job: it selects by labels every job's pods carry, so a job needs no
    permission on monitoring objects and launches unchanged on clusters without GMP. Rank 0 is the pod of
    completion index 0 (Indexed Job, and each JobSet/TrainJob child Job); other ranks serve nothing and would
    show as down."""
    return {
        "apiVersion": "monitoring.googleapis.com/v1", "kind": "PodMonitoring",
        "metadata": {"name": "shardline-rank0", "namespace": namespace},
        "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": "shardline",
                                              "batch.kubernetes.io/job-completion-index": "0"}},
                 "endpoints": [{"port": port, "path": "/metrics", "interval": f"{interval_s}s"}]},
    }
