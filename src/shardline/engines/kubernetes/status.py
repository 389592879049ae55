"""Explain a Kubernetes run's state in plain words, from the objects the API server returns.

Pure functions of recorded objects (dicts as the API returns them), so every explanation is tested on
real-shaped data: the workload's conditions, Kueue's Workload (quota, admission checks such as DWS
ProvisioningRequests, eviction), and each rank's pod (scheduling, image pulls, exit codes).
"""

from __future__ import annotations

from shardline.engines.backend import JobState, Phase, RankState

INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"  # which replicated Job (TPU slice) a JobSet pod belongs to
REPLICAS_LABEL = "jobset.sigs.k8s.io/replicatedjob-replicas"
EXIT_MEANING = {0: "finished", 1: "failed", 2: "bad input (see the log)", 75: "preempted, checkpoint committed",
                76: "hang (a rank stopped making progress)", 77: "restarting in place (JobSet InPlaceRestart)",
                137: "killed (SIGKILL: out of memory or grace period exceeded)", 143: "terminated (SIGTERM)"}


def _conditions(obj: dict | None) -> dict[str, dict]:
    return {c["type"]: c for c in ((obj or {}).get("status") or {}).get("conditions") or []}


def _true(conds: dict[str, dict], kind: str) -> dict | None:
    c = conds.get(kind)
    return c if c and c.get("status") == "True" else None


def workload_phase(work: dict) -> tuple[Phase | None, list[str]]:
    """Terminal or suspended state of the Job / JobSet / TrainJob itself."""
    conds = _conditions(work)
    for done in ("Complete", "Completed"):
        if _true(conds, done):
            return "succeeded", []
    if c := _true(conds, "Failed"):
        return "failed", [f"failed: {c.get('reason', '')} {c.get('message', '')}".strip()]
    suspended = (work.get("spec") or {}).get("suspend") or _true(conds, "Suspended")
    if suspended:
        return "queued", ["suspended: Kueue keeps the job suspended until it is admitted"]
    return None, []


def kueue_reasons(workload: dict | None) -> list[str]:
    """Why Kueue has not admitted (or has evicted) the workload."""
    if not workload:
        return []
    conds = _conditions(workload)
    out = []
    if c := _true(conds, "Evicted"):
        out.append(f"evicted by Kueue ({c.get('reason', '')}): {c.get('message', '')}")
    if not _true(conds, "Admitted"):
        quota = conds.get("QuotaReserved")
        if quota and quota.get("status") == "False":
            msg = quota.get("message", "")
            lowered = msg.lower()
            if "google.com/tpu" in lowered:
                out.append(f"queued: TPU quota exhausted in the ClusterQueue (google.com/tpu) — {msg}")
            elif "insufficient" in lowered or "quota" in lowered:
                out.append(f"queued: quota exhausted in the ClusterQueue — {msg}")
            elif "inactive" in lowered or "doesn't exist" in lowered or "does not exist" in lowered:
                out.append(f"queued: the queue is not usable — {msg}")
            else:
                out.append(f"queued: {msg}")
        for check in (workload.get("status") or {}).get("admissionChecks") or []:
            state, msg, name = check.get("state"), check.get("message", ""), check.get("name", "")
            if state == "Pending":
                out.append(f"waiting for capacity (admission check {name}, e.g. DWS flex-start): {msg}".rstrip(": "))
            elif state in ("Retry", "Rejected"):
                out.append(f"admission check {name} {state.lower()}: {msg}")
        if not out and quota is None:
            out.append("queued: waiting for Kueue to reserve quota")
    return out


def _pod_detail(pod: dict) -> tuple[str, str]:
    """(state, plain-words detail) for one pod."""
    status = pod.get("status") or {}
    phase = status.get("phase", "Unknown")
    for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        st = cs.get("state") or {}
        if waiting := st.get("waiting"):
            reason = waiting.get("reason", "")
            if reason in ("ImagePullBackOff", "ErrImagePull", "InvalidImageName"):
                return "image-error", f"image pull error ({reason}): {waiting.get('message', cs.get('image', ''))}"
            if reason and reason != "ContainerCreating":
                return "waiting", f"{reason}: {waiting.get('message', '')}".rstrip(": ")
        if term := st.get("terminated"):
            code = term.get("exitCode")
            meaning = EXIT_MEANING.get(code, term.get("reason", ""))
            return ("succeeded" if code == 0 else "failed"), f"exit {code}: {meaning}"
    if phase == "Pending":
        sched = _conditions(pod).get("PodScheduled")
        if sched and sched.get("status") == "False":
            msg = sched.get("message", "")
            if "untolerated taint" in msg:
                return "unschedulable", f"unschedulable: node taints not tolerated — {msg}"
            if "google.com/tpu" in msg or "gke-tpu-topology" in msg:
                return "unschedulable", ("unschedulable: no TPU node pool of this accelerator and topology has room "
                                         "(no capacity for the slice, a pool still scaling up, or TPU quota in the "
                                         f"region) — {msg}")
            if "Insufficient" in msg:
                return "unschedulable", f"unschedulable: not enough resources (GPU count?) — {msg}"
            if "node affinity" in msg or "node selector" in msg:
                return "unschedulable", f"unschedulable: no node matches the node selector — {msg}"
            return "unschedulable", f"unschedulable: {msg}"
        return "pending", "pod created, containers starting"
    return phase.lower(), ""


def node_rank(meta: dict, nnodes: int) -> int:
    """The pod's node rank: its completion index, offset by its Job's index when a JobSet replicates the Job
    (multislice TPU: `replicatedjob-replicas` slices of nnodes / slices hosts each; completion indexes repeat)."""
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    index = int(annotations.get(INDEX_ANNOTATION) or labels.get(INDEX_ANNOTATION) or 0)
    replicas = int(labels.get(REPLICAS_LABEL) or 1)
    if replicas > 1 and nnodes % replicas == 0:
        return int(labels.get(JOB_INDEX_LABEL) or 0) * (nnodes // replicas) + index
    return index


def rank_states(pods: list[dict], nnodes: int = 1) -> list[RankState]:
    """Newest pod per node rank (earlier attempts' pods only add to the restart count)."""
    by_rank: dict[int, list[dict]] = {}
    for p in pods:
        by_rank.setdefault(node_rank(p.get("metadata") or {}, nnodes), []).append(p)
    out = []
    for rank, group in sorted(by_rank.items()):
        group.sort(key=lambda p: p["metadata"].get("creationTimestamp") or "")
        newest = group[-1]
        state, detail = _pod_detail(newest)
        restarts = len(group) - 1 + sum(cs.get("restartCount", 0) for cs in
                                        (newest.get("status") or {}).get("containerStatuses") or [])
        out.append(RankState(rank=rank, name=newest["metadata"]["name"], state=state, restarts=restarts,
                             detail=detail))
    return out


def explain(work: dict | None, pods: list[dict], workload: dict | None, nnodes: int) -> JobState:
    if work is None:
        return JobState(phase="unknown", reasons=["the job object is gone (deleted, or cleaned up after finishing)"])
    phase, reasons = workload_phase(work)
    reasons += kueue_reasons(workload)
    ranks = rank_states(pods, nnodes)
    jobset_restarts = ((work.get("status") or {}).get("restarts")) or 0
    if phase is None:
        states = {r.state for r in ranks}
        if len(ranks) == nnodes and states == {"running"}:
            phase = "running"
        elif reasons and not ranks:
            phase = "queued"
        elif not ranks:
            phase, reasons = "queued", reasons or ["no pods yet: waiting for admission or the job controller"]
        else:
            phase = "running" if "running" in states else "starting"
    reasons += [f"rank {r.rank}: {r.detail}" for r in ranks
                if r.state in ("unschedulable", "image-error", "waiting", "failed")]
    return JobState(phase=phase, reasons=reasons, ranks=ranks, restarts=jobset_restarts)
