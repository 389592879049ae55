"""Prometheus alert rules for training jobs, built as data from the spec (`shardline observe render`).

Where each signal comes from:
- shardline's own series (rank 0's `/metrics`, observe/prometheus.py): progress, checkpoint durations,
  worker restarts;
- NVIDIA DCGM exporter (per GPU, with `pod`/`namespace` labels on Kubernetes): GPU utilisation;
- kube-state-metrics: pod phase and container restarts;
- logs, for NCCL timeouts: NCCL's watchdog aborts the process from C++ (it never reaches a Python
  handler or a metric), and what survives is its stderr line, collected by the cluster's log agent.
  Those rules are LogQL for Loki's ruler (same rule-file format, a log query as `expr`); on GKE the same
  pattern works as a log-based metric filter in Cloud Logging.
Pods are matched by name: a run's Kubernetes objects are named after `run.name`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardline.spec import JobSpec

GPU_UTIL_LOW_PERCENT = 40  # an FSDP job below this for 15 min is starved (data, network) or stuck
GPU_UTIL_LOW_FOR = "15m"
POD_PENDING_FOR = "10m"
RESTART_LOOP_RESTARTS = 3  # restarts within RESTART_LOOP_WINDOW
RESTART_LOOP_WINDOW = "30m"
CHECKPOINT_SLOWER_THAN_USUAL = 2.0  # × the save time's median over the last day
HANG_ALERT_WINDOW_S = 1800  # a hang report keeps the alert firing this long (the run restarts by itself)

# Lines NCCL / torch's ProcessGroupNCCL write when a collective times out or the watchdog gives up
# (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp), and gloo's timeout. RE2 syntax (Loki, Cloud Logging).
NCCL_TIMEOUT_PATTERN = (
    r"Watchdog caught collective operation timeout|"
    r"ProcessGroupNCCL.*(timed out|Timeout|timeout)|"
    r"NCCL (WARN|INFO).*[Tt]imeout|"
    r"Connection closed by peer.*gloo|gloo.*[Tt]imed out"
)


@dataclass(frozen=True)
class Rule:
    alert: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str
    labels: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        rule = {"alert": self.alert, "expr": self.expr}
        if self.for_ != "0m":
            rule["for"] = self.for_
        rule["labels"] = {"severity": self.severity, **self.labels}
        rule["annotations"] = {"summary": self.summary, "description": self.description}
        return rule


def pod_regex(spec: JobSpec) -> str:
    """Pods of the run's Kubernetes objects; `run.name` is [a-z0-9-], nothing to escape in a regex."""
    return f"{spec.run.name}-.*"


def _minutes(value: float) -> str:
    return f"{value:g}m"


def prometheus_rules(spec: JobSpec) -> list[Rule]:
    pods = pod_regex(spec)
    grace = spec.launch.grace_seconds
    n = spec.observe.no_progress_minutes
    return [
        Rule("ShardlineNoProgress",
             f"(time() - shardline_last_progress_timestamp_seconds > {60 * n:g})"
             ' and on (run_id) (shardline_run_status{shardline_run_status="running"} == 1)',
             "0m", "critical",
             "Run {{ $labels.run_id }} made no progress for " + _minutes(n),
             f"No step, evaluation or checkpoint finished for more than {n:g} minutes while training (the final "
             "evaluation is exempt): "
             "a hung collective, a dead data source or a stuck filesystem (observe.no_progress_minutes)."),
        Rule("ShardlineRankHung",
             f"time() - shardline_last_hang_timestamp_seconds < {HANG_ALERT_WINDOW_S}", "0m", "critical",
             "A rank of {{ $labels.run_id }} hung",
             f"The hang watchdog (launch.hang_timeout_seconds = {spec.launch.hang_timeout_seconds or 'off'}) saw no "
             f"progress, named the rank(s) whose heartbeat stopped (step, phase, stack top, host), dumped every "
             "live rank's Python stack to logs/stack-rank-*.txt and restarted the workers from the last checkpoint "
             "(exit 76). Who and where: the `hang` event in metrics.jsonl, the manifest's `hangs`. The same host "
             f"again points at that host. Fires for {HANG_ALERT_WINDOW_S // 60} minutes after each hang."),
        Rule("ShardlineCheckpointExceedsGrace",
             f"shardline_checkpoint_save_seconds > {grace}", "0m", "critical",
             "Checkpoint of {{ $labels.run_id }} took {{ $value | humanizeDuration }}",
             f"A checkpoint took longer than launch.grace_seconds = {grace}s, the time a preempted worker gets "
             "to save: a preemption now loses every step since the previous checkpoint. Raise "
             "launch.grace_seconds or make saves faster (async_save, local checkpoint.dir)."),
        Rule("ShardlineCheckpointSlow",
             f"shardline_checkpoint_save_seconds > {CHECKPOINT_SLOWER_THAN_USUAL:g} * "
             "quantile_over_time(0.5, shardline_checkpoint_save_seconds[1d])"
             " and shardline_checkpoint_save_seconds > 30",
             "0m", "warning",
             "Checkpoint of {{ $labels.run_id }} is slower than usual",
             f"The latest checkpoint took over {CHECKPOINT_SLOWER_THAN_USUAL:g}× its median of the last day "
             "(and over 30 s): storage or network degraded."),
        Rule("ShardlineRestartLoop",
             f"changes(shardline_worker_start_time_seconds[{RESTART_LOOP_WINDOW}]) >= {RESTART_LOOP_RESTARTS}"
             f' or increase(kube_pod_container_status_restarts_total{{pod=~"{pods}"}}[{RESTART_LOOP_WINDOW}])'
             f" >= {RESTART_LOOP_RESTARTS}",
             "0m", "critical",
             "Training restarts in a loop",
             f"{RESTART_LOOP_RESTARTS} or more worker restarts (torchrun or the container) within "
             f"{RESTART_LOOP_WINDOW}: each resumes from the last checkpoint and fails again. Check the logs "
             "(exit 1 retries; exit 2 would have stopped)."),
        Rule("ShardlinePodPending",
             f'max by (namespace, pod) (kube_pod_status_phase{{phase="Pending", pod=~"{pods}"}}) == 1',
             POD_PENDING_FOR, "warning",
             "Pod {{ $labels.namespace }}/{{ $labels.pod }} pending for over " + POD_PENDING_FOR,
             "The pod was not scheduled: no capacity (Kueue/DWS queueing, quota), an unsatisfiable node selector "
             "or toleration, or an image that cannot be pulled. `kubectl describe pod` says which."),
        Rule("ShardlineGPUUtilizationLow",
             f'avg by (namespace, pod, Hostname, gpu) (DCGM_FI_DEV_GPU_UTIL{{pod=~"{pods}"}})'
             f" < {GPU_UTIL_LOW_PERCENT}",
             GPU_UTIL_LOW_FOR, "warning",
             "GPU {{ $labels.gpu }} of {{ $labels.pod }} below " + f"{GPU_UTIL_LOW_PERCENT}% for {GPU_UTIL_LOW_FOR}",
             "The GPU is mostly idle: data loading, host offload, network-bound collectives or a stalled rank. "
             "Compare shardline_data_wait_seconds and shardline_mfu."),
    ]


def log_rules(spec: JobSpec) -> list[Rule]:
    """LogQL rules for Loki's ruler (not PromQL: check them with Loki's tooling, not promtool)."""
    selector = f'{{pod=~"{pod_regex(spec)}"}}'
    expr = (f"sum by (namespace, pod) (count_over_time({selector} |~ `{NCCL_TIMEOUT_PATTERN}` [5m])) > 0")
    return [Rule("ShardlineNCCLTimeout", expr, "0m", "critical",
                 "Collective timeout in {{ $labels.pod }}",
                 "NCCL's watchdog (or gloo) reported a collective operation timeout: a rank died, hung or lost "
                 "its network. The job restarts from its last checkpoint; a recurring timeout on the same node "
                 "points at its NICs or at uneven work between ranks.")]


def rule_file(name: str, rules: list[Rule]) -> dict:
    return {"groups": [{"name": name, "rules": [r.as_dict() for r in rules]}]}
