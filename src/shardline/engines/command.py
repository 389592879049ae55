"""The one worker command line (docs/architecture.md §6) and the torchrun line every cluster engine runs on each node.

Cluster engines differ only in how they supply node rank and the rendezvous host: torchrun reads
`PET_NODE_RANK`, `PET_MASTER_ADDR` and `PET_MASTER_PORT` as defaults for its flags, the variables
Kubeflow Trainer injects, so the Indexed Job, the JobSet, the TrainJob and Slurm set the same three
variables and the command line is identical everywhere.
"""

from __future__ import annotations

from pathlib import Path

from shardline.engines.elastic import torchrun_node_flags
from shardline.spec import JobSpec

FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
CLUSTER_METRICS_HOST = "0.0.0.0"  # a pod's or node's /metrics must be reachable by the cluster's scraper
RANK_ENV = ("PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")


def cluster_spec(spec: JobSpec) -> JobSpec:
    """The spec as a cluster launcher ships it: an unset `observe.metrics_host` binds all interfaces there."""
    if spec.observe.metrics_host is not None:
        return spec
    spec = spec.model_copy(deep=True)
    spec.observe.metrics_host = CLUSTER_METRICS_HOST
    return spec


def local_spec(spec: JobSpec, launched_by: str | None) -> JobSpec:
    """The spec of a run resumed on this machine: a cluster launch (`launched_by` is its target) bound /metrics
    on every interface for the cluster's scraper; here it serves on loopback again (an explicit host stays)."""
    if launched_by in (None, "local") or spec.observe.metrics_host != CLUSTER_METRICS_HOST:
        return spec
    spec = spec.model_copy(deep=True)
    spec.observe.metrics_host = None
    return spec


def worker_command(spec_path: Path | str, task: str = "train") -> list[str]:
    """The worker invocation shared by every launcher (docs/architecture.md §6)."""
    return ["-m", "shardline.worker", "--spec", str(spec_path), "--task", task]


def torchrun_policy_flags(spec: JobSpec) -> list[str]:
    """Restart and stop behaviour, the same on every engine."""
    return [f"--max-restarts={spec.launch.max_restarts}", f"--signals-to-handle={FORWARDED_SIGNALS}",
            f"--shutdown-timeout={spec.launch.grace_seconds}"]


def node_torchrun_command(spec: JobSpec, spec_path: Path | str, task: str = "train",
                          python: str = "python", rdzv_endpoint: str | None = None) -> list[str]:
    """One node's torchrun for a multi-node job; rank and rendezvous address come from the PET_* environment,
    an elastic job's c10d endpoint from `rdzv_endpoint` where the engine knows it at render time."""
    return [python, "-m", "shardline.engines.torchrun", *torchrun_node_flags(spec, rdzv_endpoint),
            f"--nproc-per-node={spec.parallel.nproc_per_node}", *torchrun_policy_flags(spec),
            *worker_command(spec_path, task)]
