"""shardline as a Kubeflow Trainer runtime: the (Cluster)TrainingRuntime a cluster installs so that TrainJobs —
`launch --target trainjob` or the Kubeflow SDK's `TrainerClient().train(...)` — run shardline's worker.

Built from a job spec that stands for the cluster's training pods (its profile, image, GPUs, storage):
- `mlPolicy.torch`: Trainer's torch plugin injects PET_NNODES/NPROC_PER_NODE/NODE_RANK/MASTER_ADDR/MASTER_PORT;
  processes per node are the GPUs each pod requests (`parallel.nproc_per_node`), or the TrainJob's numProcPerNode;
- one replicated job `node` (label `trainjob-ancestor-step: trainer`, container `node`: what the SDK and the
  controller look for), the shardline image pinned by digest, the worker command, the rank-0 metrics port
  named (a TrainJob cannot patch ports), GPUs, the fabric's host paths, NICs and capabilities, the FUSE mounts;
- the Job's podFailurePolicy and the JobSet's failure policy every other target has (engines/kubernetes/objects.py):
  exit 2 fails at once, exit 75 (preempted, checkpoint committed) and node disruption replace pods for free.
The job spec itself is not in the runtime: `--target trainjob` mounts it from the run's ConfigMap (a runtime
patch), and the SDK path carries it in the command it writes (engines/kubeflow_sdk.py).
"""

from __future__ import annotations

from shardline.engines.kubernetes import pod as k8s_pod
from shardline.engines.kubernetes.objects import REPLICATED_JOB, TRAINJOB_API, pod_failure_policy
from shardline.engines.kubernetes.trainjob import check_trainjob
from shardline.errors import SpecError
from shardline.spec import JobSpec

RUNTIME_NAME = "shardline"
KINDS = {"cluster": "ClusterTrainingRuntime", "namespaced": "TrainingRuntime"}
FRAMEWORK_LABEL = "trainer.kubeflow.org/framework"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
TRAINER_STEP = "trainer"
SPEC_VOLUME = "spec"
"""The run's ConfigMap volume: per job, so a TrainJob patches it in; the runtime has none."""


def _runtime_pod(spec: JobSpec) -> tuple[dict, dict]:
    """The pod template's metadata and spec, without the per-job spec volume."""
    pod = k8s_pod.pod_spec(spec, "train", "unused", [], subdomain=None)
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] != SPEC_VOLUME]
    node = pod["containers"][0]
    node["volumeMounts"] = [m for m in node["volumeMounts"] if m["name"] != SPEC_VOLUME]
    # Not the storage as workingDir: the SDK writes its function file into the working directory, and on shared
    # storage every pod would rewrite that one file while others run it. The command enters the storage (as the
    # TrainJob's does); the SDK's command, which replaces it, enters it in its entry point (engines/kubeflow_sdk.py).
    if "workingDir" in node:
        node["command"] = k8s_pod.node_command(spec, "train", workdir=node.pop("workingDir"))
    meta: dict = {"labels": {"app.kubernetes.io/name": "shardline"}}
    if annotations := k8s_pod.pod_annotations(spec):
        meta["annotations"] = annotations
    return meta, pod


def training_runtime(spec: JobSpec, scope: str = "cluster") -> dict:
    """The ClusterTrainingRuntime (scope `cluster`) or the TrainingRuntime in the spec's namespace
    (`namespaced`) named `launch.kubernetes.trainjob_runtime`."""
    if scope not in KINDS:
        raise SpecError("--trainer-runtime", f"unknown scope {scope!r}", f"use one of {', '.join(KINDS)}")
    check_trainjob(spec)
    if not spec.launch.image_digest:
        raise SpecError("launch.image_digest", "is not set, but a runtime serves every TrainJob of the cluster "
                        "and must not change under them when a tag moves", "push the image and set "
                        "launch.image_digest (sha256:...) to pin it")
    pod_meta, pod = _runtime_pod(spec)
    job = {"metadata": {"labels": {ANCESTOR_LABEL: TRAINER_STEP}},
           "spec": {"backoffLimit": 0, "podFailurePolicy": pod_failure_policy(),
                    "template": {"metadata": pod_meta, "spec": pod}}}
    meta: dict = {"name": spec.launch.kubernetes.trainjob_runtime,
                  "labels": {FRAMEWORK_LABEL: "torch", "app.kubernetes.io/name": "shardline",
                             "app.kubernetes.io/managed-by": "shardline"}}
    if scope == "namespaced":
        meta["namespace"] = spec.launch.kubernetes.namespace
    return {"apiVersion": TRAINJOB_API, "kind": KINDS[scope], "metadata": meta, "spec": {
        # Trainer ≥ 2.3 has no processes-per-node in the runtime's torch policy: the plugin reads them from the
        # TrainJob's trainer.numProcPerNode (`--target trainjob` sets it), else from the node's GPU limit (below).
        "mlPolicy": {"numNodes": spec.launch.nnodes, "torch": {}},
        "template": {"spec": {
            "failurePolicy": {"maxRestarts": spec.launch.max_restarts, "rules": [
                {"name": "bad-input", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"],
                 "onJobFailureMessagePatterns": [k8s_pod.BAD_INPUT_FAILURE]}]},
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": job}]}}}}
