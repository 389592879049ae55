"""TPU multislice on GKE: a JobSet with one replicated Job per slice, every pod running MaxText (tpu/maxtext.py).

The shape follows GKE's multislice JobSet ("Deploy TPU Multislice in GKE", cloud.google.com/kubernetes-engine/docs/
how-to/tpu-multislice) and the JobSets XPK and axlearn build for MaxText:
- `replicatedJobs[0].replicas` = slices; each Job is Indexed with one pod per TPU VM host of the slice;
- `alpha.jobset.sigs.k8s.io/exclusive-topology: cloud.google.com/gke-nodepool`: each slice's Job gets a node pool of
  its own (a multi-host TPU node pool is one slice), so two slices never share one;
- node selectors `cloud.google.com/gke-tpu-accelerator` and `cloud.google.com/gke-tpu-topology`, and
  `google.com/tpu` = chips per host as request and limit (GKE's TPU device plugin);
- GKE's TPU webhook gives each pod of an Indexed Job TPU_WORKER_ID and TPU_WORKER_HOSTNAMES (JAX's rank and
  coordinator inside a slice); across slices libtpu reads MEGASCALE_NUM_SLICES, MEGASCALE_SLICE_ID and
  MEGASCALE_COORDINATOR_ADDRESS, taken here from the JobSet's own labels (jobset.sigs.k8s.io/replicatedjob-replicas,
  jobset.sigs.k8s.io/job-index) and slice 0's first pod, as axlearn's GKE TPU builder does;
- failure policy: a preempted node (pod condition DisruptionTarget) fails its Job, and the JobSet restarts every
  slice without counting it against launch.max_restarts (MaxText resumes from its last checkpoint in
  base_output_directory); exit 2 is never retried, as on GPUs (docs/architecture.md §7);
- Kueue queue label and DWS flex-start annotation, spot node selection and GCS FUSE: the GPU path's helpers.
"""

from __future__ import annotations

from shardline.engines.kubernetes import pod as k8s_pod
from shardline.engines.kubernetes.preemption import SPOT_LABEL, capacity, termination_grace_seconds
from shardline.engines.tpu.maxtext import maxtext_command
from shardline.errors import SpecError
from shardline.hardware import TpuSlice, tpu_slice
from shardline.spec import JobSpec

TPU_RESOURCE = "google.com/tpu"
ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"
SLICE_JOB = "slice"
PREEMPTED = "DisruptionTarget matching FailJob rule"


def slice_of(spec: JobSpec) -> TpuSlice:
    return tpu_slice(spec.launch.tpu.type, spec.launch.tpu.topology)


def tpu_node_selector(spec: JobSpec) -> dict[str, str]:
    sl = slice_of(spec)
    out = {ACCELERATOR_LABEL: sl.generation.gke_accelerator, TOPOLOGY_LABEL: sl.topology}
    if capacity(spec) == "spot":
        out[SPOT_LABEL] = "true"
    return out | spec.launch.kubernetes.node_selector


def tpu_tolerations(spec: JobSpec) -> list[dict]:
    out = [t.model_dump(exclude_none=True) for t in spec.launch.kubernetes.tolerations]
    out.append({"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    if capacity(spec) == "spot":
        out.append({"key": SPOT_LABEL, "operator": "Equal", "value": "true", "effect": "NoSchedule"})
    return out


def tpu_resources(spec: JobSpec) -> dict:
    k = spec.launch.kubernetes
    chips = str(slice_of(spec).chips_per_host)
    requests = {TPU_RESOURCE: chips} | ({"cpu": k.cpu} if k.cpu else {}) | ({"memory": k.memory} if k.memory else {})
    return {"requests": requests, "limits": {TPU_RESOURCE: chips}}


def megascale_env(name: str, replicated_job: str) -> list[dict]:
    """libtpu's multislice settings, read off the JobSet's labels; the coordinator is slice 0's first host."""
    return [
        {"name": "MEGASCALE_NUM_SLICES", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.labels['jobset.sigs.k8s.io/replicatedjob-replicas']"}}},
        {"name": "MEGASCALE_SLICE_ID", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.labels['jobset.sigs.k8s.io/job-index']"}}},
        {"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": f"{name}-{replicated_job}-0-0.{name}"},
    ]


def tpu_env(spec: JobSpec, extra: list[dict]) -> list[dict]:
    env = [*extra, {"name": "PYTHONUNBUFFERED", "value": "1"},
           {"name": "SHARDLINE_IMAGE", "value": k8s_pod.image_ref(spec)}]
    for key, ref in sorted(spec.launch.kubernetes.secret_env.items()):
        env.append({"name": key, "valueFrom": {"secretKeyRef": {"name": ref.secret, "key": ref.key}}})
    return env


def tpu_pod_spec(spec: JobSpec, container_name: str, command: list[str] | None, env: list[dict],
                 config_map: str, resources: dict) -> dict:
    """One TPU VM host's pod: all its chips, the slice's node pool, /dev/shm and shared storage."""
    k = spec.launch.kubernetes
    volumes, mounts = k8s_pod.volumes_and_mounts(spec, config_map, gpu=False)
    container: dict = {"name": container_name, "image": k8s_pod.image_ref(spec), "env": env,
                       "volumeMounts": mounts, "securityContext": k8s_pod.CONTAINER_SECURITY, "resources": resources}
    if command:
        container["command"] = command
    if k.storage.kind != "none":
        container["workingDir"] = k.storage.mount_path
    out = {"restartPolicy": "Never", "serviceAccountName": k.service_account, "automountServiceAccountToken": False,
           "securityContext": k8s_pod.POD_SECURITY, "terminationGracePeriodSeconds": termination_grace_seconds(spec),
           "containers": [container], "volumes": volumes, "nodeSelector": tpu_node_selector(spec),
           "tolerations": tpu_tolerations(spec)}
    if k.priority_class:
        out["priorityClassName"] = k.priority_class
    return out


def pod_metadata(spec: JobSpec) -> dict:
    meta: dict = {"labels": k8s_pod.labels(spec)}
    if ann := k8s_pod.storage_annotations(spec):
        meta["annotations"] = ann
    return meta


def tpu_jobset(spec: JobSpec, meta: dict, config_map: str) -> dict:
    """The multislice JobSet; `meta` is the object metadata the caller builds (labels, Kueue, DWS annotations)."""
    tp = spec.launch.tpu
    if tp.min_slices is not None and tp.min_slices < tp.slices:
        raise SpecError("launch.tpu.min_slices", f"is {tp.min_slices} of {tp.slices}, but a JobSet runs a fixed "
                        "number of slices", "unset launch.tpu.min_slices, or use --target rayjob for elastic slices")
    name = meta["name"]
    hosts = slice_of(spec).hosts
    env = tpu_env(spec, megascale_env(name, SLICE_JOB) if tp.slices > 1 else [])
    pod = {"metadata": pod_metadata(spec),
           "spec": tpu_pod_spec(spec, k8s_pod.CONTAINER, maxtext_command(spec), env, config_map, tpu_resources(spec))}
    on_exit = {"containerName": k8s_pod.CONTAINER, "operator": "In"}
    job = {"metadata": {"labels": k8s_pod.labels(spec)},
           "spec": {"completionMode": "Indexed", "completions": hosts, "parallelism": hosts, "backoffLimit": 0,
                    "podFailurePolicy": {"rules": [
                        {"action": "FailJob", "onExitCodes": {**on_exit, "values": [2]}},
                        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]},
                    "template": pod}}
    annotations = {**meta.get("annotations", {}), EXCLUSIVE_TOPOLOGY: NODE_POOL_LABEL}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {**meta, "annotations": annotations},
            "spec": {"network": {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
                     "failurePolicy": {"maxRestarts": spec.launch.max_restarts,
                                       "restartStrategy": spec.launch.kubernetes.restart_strategy, "rules": [
                         {"name": "bad-input", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"],
                          "onJobFailureMessagePatterns": [k8s_pod.BAD_INPUT_FAILURE]},
                         {"name": "preempted", "action": "RestartJobSetAndIgnoreMaxRestarts",
                          "onJobFailureReasons": ["PodFailurePolicy"], "onJobFailureMessagePatterns": [PREEMPTED]}]},
                     "successPolicy": {"operator": "All"},
                     "replicatedJobs": [{"name": SLICE_JOB, "replicas": tp.slices, "template": job}]}}
