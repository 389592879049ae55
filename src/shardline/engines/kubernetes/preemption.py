"""What the capacity a job runs on grants it when it is taken away, and what that means for its checkpoints.

On GKE a Spot VM is reclaimed 30 s after its preemption notice; the kubelet's graceful node shutdown gives
non-system pods 15 s of that, best effort (https://cloud.google.com/kubernetes-engine/docs/concepts/spot-vms).
A DWS flex-start node is removed when the request's maxRunDurationSeconds ends
(https://cloud.google.com/kubernetes-engine/docs/how-to/provisioningrequest). `launch.grace_seconds` (60 by
default) is the checkpoint-on-SIGTERM budget the worker assumes; on spot the platform grants less.
"""

from __future__ import annotations

from typing import Literal

from shardline.errors import SpecError
from shardline.spec import JobSpec

SPOT_SHUTDOWN_S = 15
"""Seconds GKE's graceful node shutdown grants a non-system pod on a reclaimed Spot VM."""
SPOT_LABEL = "cloud.google.com/gke-spot"
Capacity = Literal["spot", "dws-flex-start", "on-demand"]


def capacity(spec: JobSpec) -> Capacity:
    """Spot when cost.provisioning says so or the pods select spot nodes; flex-start with a DWS run limit."""
    k = spec.launch.kubernetes
    if spec.cost.provisioning == "spot" or k.node_selector.get(SPOT_LABEL) == "true":
        return "spot"
    if spec.cost.provisioning == "dws-flex-start" or k.max_run_seconds:
        return "dws-flex-start"
    return "on-demand"


def termination_grace_seconds(spec: JobSpec) -> int:
    """The pod's terminationGracePeriodSeconds: what the platform grants on spot, else the worker's budget plus
    30 s for the torchrun wrapper and the GCS FUSE sidecar to flush."""
    if capacity(spec) == "spot":
        return SPOT_SHUTDOWN_S
    return spec.launch.grace_seconds + 30


def preemption_notes(spec: JobSpec) -> list[str]:
    """Plain-words risks of the job's capacity, for `render`, `launch --dry-run` and `cluster plan gke`.
    Refuses spot capacity without periodic checkpoints: a preemption would lose the whole run."""
    every = spec.checkpoint.every_steps
    kind = capacity(spec)
    if kind == "spot":
        if every is None:
            raise SpecError("checkpoint.every_steps", "is unset on spot capacity, where GKE gives a preempted pod "
                            f"{SPOT_SHUTDOWN_S} s: the checkpoint written on SIGTERM rarely fits, and nothing "
                            "else would survive a preemption", "set checkpoint.every_steps (a preemption then "
                            "loses at most that many steps), or run on on-demand or DWS capacity")
        notes = [f"spot capacity: a preempted pod gets {SPOT_SHUTDOWN_S} s (GKE graceful node shutdown), so "
                 f"terminationGracePeriodSeconds is {SPOT_SHUTDOWN_S}; a preemption loses up to "
                 f"checkpoint.every_steps={every} steps"]
        if spec.launch.grace_seconds > SPOT_SHUTDOWN_S:
            notes.append(f"launch.grace_seconds={spec.launch.grace_seconds} assumes more time than spot grants: the "
                         "checkpoint on SIGTERM may be cut off; the last periodic checkpoint is the fallback")
        return notes
    if kind == "dws-flex-start":
        limit = spec.launch.kubernetes.max_run_seconds
        note = ("DWS flex-start capacity: the nodes are removed when the run limit ends"
                + (f" (launch.kubernetes.max_run_seconds={limit})" if limit else ""))
        if every is None:
            note += "; checkpoint.every_steps is unset, so only the checkpoint on SIGTERM saves the run"
        return [note]
    return []
