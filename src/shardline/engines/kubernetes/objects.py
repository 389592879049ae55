"""Kubernetes objects for one run: the resolved spec as a ConfigMap plus an Indexed Job (with its headless
Service), a JobSet, or a Kubeflow TrainJob. All three run the same pod (engines/kubernetes/pod.py).

Failure handling follows docs/architecture.md §7 on every target:
- exit 2 (bad input) fails the job at once, never retried;
- exit 75 (preempted; a checkpoint was committed) and node disruption replace the pods without using up
  the restart budget — all ranks agree to stop at the same step, so every pod exits 75 together;
- anything else: torchrun restarts the workers in place up to `launch.max_restarts` times; when a pod
  itself fails, the JobSet recreates the whole gang (again up to `launch.max_restarts`), the plain Indexed
  Job fails (no gang restart without JobSet), the TrainJob follows its runtime's JobSet failure policy.
"""

from __future__ import annotations

from shardline.engines.command import cluster_spec
from shardline.engines.kubernetes import pod as k8s_pod
from shardline.engines.kubernetes.preemption import preemption_notes
from shardline.engines.kubernetes.trainjob import check_trainjob, split_pod
from shardline.errors import SpecError
from shardline.network_profiles import RENDEZVOUS_PORT
from shardline.spec import JobSpec
from shardline.spec.resolve import spec_to_yaml

TARGETS = ("k8s-job", "jobset", "trainjob")
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
TRAINJOB_API = "trainer.kubeflow.org/v1alpha1"
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
REPLICATED_JOB = "node"


def check_cluster_spec(spec: JobSpec) -> None:
    st = spec.launch.kubernetes.storage
    if spec.launch.nnodes > 1 and st.kind == "none" and "://" not in (spec.checkpoint.dir or ""):
        raise SpecError("launch.kubernetes.storage.kind", "is none, but a multi-node job needs one checkpoint "
                        "location every node can write", "use gcsfuse or pvc, or set checkpoint.dir to an "
                        "s3:// or gs:// URL")
    if spec.launch.kubernetes.max_run_seconds and not spec.launch.kubernetes.queue:
        raise SpecError("launch.kubernetes.max_run_seconds", "needs a Kueue queue (DWS flex-start runs through "
                        "Kueue's ProvisioningRequest admission check)", "set launch.kubernetes.queue")


def _meta(spec: JobSpec, name: str, extra_labels: dict[str, str] | None = None,
          annotations: dict[str, str] | None = None) -> dict:
    meta = {"name": name, "namespace": spec.launch.kubernetes.namespace, "labels": k8s_pod.labels(spec)}
    if extra_labels:
        meta["labels"] = meta["labels"] | extra_labels
    if annotations:
        meta["annotations"] = annotations
    return meta


def queue_labels(spec: JobSpec) -> dict[str, str]:
    """Kueue labels on the top-level object; Kueue then owns `suspend`, which is never set here."""
    k = spec.launch.kubernetes
    out = {}
    if k.queue:
        out["kueue.x-k8s.io/queue-name"] = k.queue
    if k.workload_priority_class:
        out["kueue.x-k8s.io/priority-class"] = k.workload_priority_class
    return out


def job_annotations(spec: JobSpec) -> dict[str, str]:
    """Kueue copies `provreq.kueue.x-k8s.io/*` annotations into the DWS ProvisioningRequest."""
    k = spec.launch.kubernetes
    return {"provreq.kueue.x-k8s.io/maxRunDurationSeconds": str(k.max_run_seconds)} if k.max_run_seconds else {}


def config_map(spec: JobSpec, name: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(spec, f"{name}-spec"),
            "data": {"spec.yaml": spec_to_yaml(cluster_spec(spec))}}


def rank0_host(spec: JobSpec, target: str) -> str:
    name = k8s_pod.object_name(spec)
    if target == "k8s-job":
        return f"{name}-0.{name}"
    return f"{name}-{REPLICATED_JOB}-0-0.{name}"  # JobSet pod hostname under the JobSet's subdomain


def rdzv_endpoint(spec: JobSpec, target: str) -> str | None:
    """An elastic job's c10d store: rank 0's pod by its stable DNS name, so every pod joins the same one."""
    return f"{rank0_host(spec, target)}:{RENDEZVOUS_PORT}" if spec.is_elastic else None


def _rank_env(spec: JobSpec, target: str) -> list[dict]:
    if target == "trainjob":
        return []  # Kubeflow Trainer injects PET_NNODES/NPROC_PER_NODE/NODE_RANK/MASTER_ADDR/MASTER_PORT
    return [{"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
            {"name": "PET_MASTER_ADDR", "value": rank0_host(spec, target)},
            {"name": "PET_MASTER_PORT", "value": str(RENDEZVOUS_PORT)}]


def pod_failure_policy() -> dict:
    on_exit = {"containerName": k8s_pod.CONTAINER, "operator": "In"}
    return {"rules": [
        {"action": "FailJob", "onExitCodes": {**on_exit, "values": [2]}},
        {"action": "Ignore", "onExitCodes": {**on_exit, "values": [75]}},
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]}


MAX_BACKOFF_LIMIT = 2**31 - 1
"""JobSet InPlaceRestart: a Job must never fail for its pods' failures (the controller counts restarts)."""


def _job_spec(spec: JobSpec, target: str, task: str, cm: str, subdomain: str) -> dict:
    n = spec.launch.nnodes
    out = {"completionMode": "Indexed", "completions": n, "parallelism": n, "backoffLimit": 0,
           "podFailurePolicy": pod_failure_policy(),
           "template": k8s_pod.pod_template(spec, task, cm, _rank_env(spec, target), subdomain,
                                            rdzv_endpoint(spec, target))}
    if spec.launch.kubernetes.restarts_in_place:  # a failed pod is replaced alone, once it is gone; the others stay
        out |= {"backoffLimit": MAX_BACKOFF_LIMIT, "podReplacementPolicy": "Failed"}
    return out


def indexed_job(spec: JobSpec, task: str) -> list[dict]:
    name = k8s_pod.object_name(spec)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, name),
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                        "selector": {"batch.kubernetes.io/job-name": name},
                        "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT}]}}
    job = {"apiVersion": "batch/v1", "kind": "Job",
           "metadata": _meta(spec, name, queue_labels(spec), job_annotations(spec)),
           "spec": _job_spec(spec, "k8s-job", task, f"{name}-spec", subdomain=name)}
    return [service, job]


def jobset(spec: JobSpec, task: str) -> list[dict]:
    name = k8s_pod.object_name(spec)
    job_template = {"metadata": {"labels": k8s_pod.labels(spec)},
                    "spec": _job_spec(spec, "jobset", task, f"{name}-spec", subdomain=None)}
    bad_input = k8s_pod.BAD_INPUT_FAILURE
    js = {"apiVersion": JOBSET_API, "kind": "JobSet",
          "metadata": _meta(spec, name, queue_labels(spec), job_annotations(spec)),
          "spec": {"network": {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
                   "failurePolicy": {"maxRestarts": spec.launch.max_restarts,
                                     "restartStrategy": spec.launch.kubernetes.restart_strategy, "rules": [
                       {"name": "bad-input", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"],
                        "onJobFailureMessagePatterns": [bad_input]}]},
                   "successPolicy": {"operator": "All"},
                   "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": job_template}]}}
    return [js]


def trainjob(spec: JobSpec, task: str) -> list[dict]:
    """TrainJob: the trainer's command/env/resources go in `trainer`; everything else in the pod spec is a
    runtime patch on the runtime's `node` replicated job (Trainer ≥ 2.2); engines/kubernetes/trainjob.py decides."""
    check_trainjob(spec)
    name = k8s_pod.object_name(spec)
    trainer, patched_pod = split_pod(spec, task, k8s_pod.pod_spec(spec, task, f"{name}-spec", [], subdomain=None))
    pod_meta = {"labels": k8s_pod.labels(spec)}
    if ann := k8s_pod.pod_annotations(spec):
        pod_meta["annotations"] = ann
    patch = {"manager": "shardline.dev/launcher", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": REPLICATED_JOB, "template": {"spec": {"template": {"metadata": pod_meta, "spec": patched_pod}}}}]}}}}
    tj = {"apiVersion": TRAINJOB_API, "kind": "TrainJob",
          "metadata": _meta(spec, name, queue_labels(spec), job_annotations(spec)),
          "spec": {"runtimeRef": {"name": spec.launch.kubernetes.trainjob_runtime}, "trainer": trainer,
                   "runtimePatches": [patch]}}
    return [tj]


def render_objects(spec: JobSpec, target: str, task: str = "train") -> list[dict]:
    """Every object `launch` applies, in apply order (the ConfigMap first: pods mount it)."""
    if target not in TARGETS:
        raise SpecError("--target", f"unknown Kubernetes target {target!r}", f"use one of {', '.join(TARGETS)}")
    if spec.run.id is None:
        raise SpecError("run.id", "is not assigned", "render through `shardline render`/`launch`, which assign it")
    check_cluster_spec(spec)
    k8s_pod.check_restart_strategy(spec, target)
    preemption_notes(spec)  # refuses spot capacity that nothing would save from a preemption
    if spec.train.engine == "maxtext":
        return _maxtext_objects(spec, target)
    builders = {"k8s-job": indexed_job, "jobset": jobset, "trainjob": trainjob}
    return [config_map(spec, k8s_pod.object_name(spec)), *builders[target](spec, task)]


def _maxtext_objects(spec: JobSpec, target: str) -> list[dict]:
    """MaxText on TPU slices: only a JobSet expresses slices (one replicated Job each); engines/tpu/jobset.py."""
    from shardline.engines.tpu.jobset import tpu_jobset

    if target != "jobset":
        raise SpecError("--target", f"{target} cannot run train.engine=maxtext on TPU slices",
                        "use --target jobset (multislice JobSet) or --target rayjob (KubeRay)")
    name = k8s_pod.object_name(spec)
    cm = config_map(spec, name)
    return [cm, tpu_jobset(spec, _meta(spec, name, queue_labels(spec), job_annotations(spec)), cm["metadata"]["name"])]
