"""KubeRay RayJob for MaxText on TPU slices (train.engine maxtext, --target rayjob).

As KubeRay's TPU guide (docs.ray.io/en/latest/cluster/kubernetes/user-guides/tpu.html) and GKE's "Train Llama on
TPUs with KubeRay and MaxText" lay it out: a CPU head, and one TPU worker group whose every replica is one slice —
`numOfHosts` pods (one per TPU VM host), each with all its chips (`google.com/tpu`), on the node pool selected by
`cloud.google.com/gke-tpu-accelerator` / `gke-tpu-topology`. Ray itself advertises `TPU` (chips) and
`TPU-<pod type>-head` (host 0 of each slice) on those pods; the driver (engines/tpu/ray_driver.py) schedules MaxText
onto them. Elastic on spot: `minReplicas` = launch.tpu.min_slices with KubeRay's in-tree autoscaler, so the job
starts once that many slices are up and the driver sizes MaxText's mesh to the slices it got.
"""

from __future__ import annotations

import json
import shlex

import yaml

from shardline.engines.kubernetes import pod as k8s_pod
from shardline.engines.kubernetes.objects import config_map, job_annotations, queue_labels
from shardline.engines.tpu.jobset import pod_metadata, slice_of, tpu_env, tpu_pod_spec, tpu_resources
from shardline.engines.tpu.maxtext import maxtext_command
from shardline.errors import SpecError
from shardline.hardware import TpuSlice
from shardline.spec import JobSpec

DRIVER_MODULE = "shardline.engines.tpu.ray_driver"


def ray_head_resource(sl: TpuSlice) -> str:
    pod_type = sl.generation.ray_pod_type.format(chips=sl.chips, cores=2 * sl.chips)
    return f"TPU-{pod_type}-head"


def command_for(spec: JobSpec, slices: int) -> list[str]:
    """The MaxText argv for `slices` slices: the mesh's DCN axis and the gradient accumulation follow the count."""
    s = spec.model_copy(deep=True)
    s.launch.tpu.slices = slices
    s.launch.nnodes = slices * slice_of(spec).hosts
    if spec.parallel.dp_replicate != 1:
        s.parallel.dp_replicate = slices
    per_step = s.world_size * s.train.micro_batch_size
    if s.train.global_batch_size % per_step:
        raise SpecError("train.global_batch_size", f"{s.train.global_batch_size} is not divisible by chips × "
                        f"micro-batch = {per_step} on {slices} slice(s), a size this elastic job may run at",
                        "make it a multiple for every slice count from launch.tpu.min_slices to launch.tpu.slices")
    return maxtext_command(s)


def tpu_rayjob_manifests(spec: JobSpec, ray_version: str) -> list[dict]:
    """ConfigMap (the resolved spec, for the record) and the RayJob."""
    k, tp = spec.launch.kubernetes, spec.launch.tpu
    sl = slice_of(spec)
    low = tp.min_slices or tp.slices
    commands = {str(n): command_for(spec, n) for n in range(low, tp.slices + 1)}
    name = k8s_pod.object_name(spec)
    cm = config_map(spec, name)
    cm_name = cm["metadata"]["name"]
    head_resources = {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "8Gi"}}
    head_spec = tpu_pod_spec(spec, "ray-head", None, tpu_env(spec, []), cm_name, head_resources)
    for key in ("nodeSelector", "tolerations", "restartPolicy", "terminationGracePeriodSeconds"):
        head_spec.pop(key)  # the head runs on the CPU pool
    worker_spec = tpu_pod_spec(spec, "ray-worker", None, tpu_env(spec, []), cm_name, tpu_resources(spec))
    worker_spec.pop("restartPolicy")
    entrypoint = shlex.join(["python3", "-m", DRIVER_MODULE, "--head-resource", ray_head_resource(sl),
                             "--hosts", str(sl.hosts), "--chips-per-host", str(sl.chips_per_host),
                             "--min-slices", str(low), "--max-slices", str(tp.slices),
                             "--commands", json.dumps(commands, separators=(",", ":"))])
    meta = {"name": name, "namespace": k.namespace, "labels": k8s_pod.labels(spec) | queue_labels(spec)}
    if annotations := job_annotations(spec):
        meta["annotations"] = annotations
    cluster: dict = {
        "rayVersion": ray_version,
        "headGroupSpec": {"rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
                          "template": {"metadata": pod_metadata(spec), "spec": head_spec}},
        "workerGroupSpecs": [{
            "groupName": f"tpu-{sl.accelerator.key}-{sl.topology}", "replicas": tp.slices, "minReplicas": low,
            "maxReplicas": tp.slices, "numOfHosts": sl.hosts, "rayStartParams": {},
            "template": {"metadata": pod_metadata(spec), "spec": worker_spec}}],
    }
    if low < tp.slices:
        cluster["enableInTreeAutoscaling"] = True
    rayjob = {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": meta,
              "spec": {"entrypoint": entrypoint, "shutdownAfterJobFinishes": True, "ttlSecondsAfterFinished": 3600,
                       "backoffLimit": spec.launch.max_restarts, "rayClusterSpec": cluster}}
    return [cm, rayjob]


def render_tpu_rayjob(spec: JobSpec, ray_version: str) -> dict[str, str]:
    return {"rayjob.yaml": yaml.safe_dump_all(tpu_rayjob_manifests(spec, ray_version), sort_keys=False)}
