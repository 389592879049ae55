"""Ray backends: `--target ray` submits a Ray job to a running cluster; `--target rayjob` renders a KubeRay RayJob.

Both run the same entrypoint, `python -m shardline.engines.ray.train`, which trains under Ray Train's
TorchTrainer with one worker per rank (launch.nnodes × parallel.nproc_per_node). The NCCL environment
of the profile reaches every worker through the job's runtime_env.

`ray` talks to the Ray Jobs API (`launch.ray.address`, the dashboard; needs `shardline[ray]`): the spec
travels inside the entrypoint command line, so the head needs no shared file to start; the run
directory (checkpoints, metrics, per-rank logs) must be on storage every Ray node mounts, and a
relative `run.dir` is made absolute against the directory `shardline launch` runs in. Secrets
(`launch.ray.secret_env`) are copied by name from the submitting environment into the runtime_env that
`submit` sends; they are never rendered or written to a file (Ray's own job info does hold them).
"""

from __future__ import annotations

import json
import shlex
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import yaml

from shardline.engines.backend import JobState, LaunchRecord, save_record
from shardline.engines.command import cluster_spec
from shardline.engines.kubernetes.api import create_all
from shardline.engines.ray.train import num_workers
from shardline.engines.secret_env import from_environment
from shardline.errors import ShardlineError, SpecError
from shardline.network_profiles import get_profile, nccl_environment
from shardline.rundir import new_run_id
from shardline.spec import JobSpec
from shardline.spec.resolve import spec_to_yaml
from shardline.spec.rules import require_torch_engine

ENTRYPOINT_MODULE = "shardline.engines.ray.train"
PHASES = {"PENDING": "queued", "RUNNING": "running", "SUCCEEDED": "succeeded", "FAILED": "failed",
          "STOPPED": "failed"}


def _absolute(path: str | None) -> str | None:
    if path is None or "://" in path:
        return path
    return str(Path(path).resolve())


def resolved_for_cluster(spec: JobSpec) -> JobSpec:
    """A run id assigned and local paths made absolute, so every Ray process finds the same run directory."""
    spec = spec.model_copy(deep=True)
    if spec.run.id is None:
        spec.run.id = new_run_id(spec.run.name)
    spec.run.dir = _absolute(spec.run.dir)
    spec.data.cache_dir = _absolute(spec.data.cache_dir)
    spec.checkpoint.dir = _absolute(spec.checkpoint.dir)
    return spec


def runtime_env(spec: JobSpec, secrets: dict[str, str] | None = None) -> dict:
    """The job's runtime_env; `secrets` (values from the submitting environment) only ever go to the Jobs API."""
    env = {"TOKENIZERS_PARALLELISM": "false", **nccl_environment(get_profile(spec.launch.profile)), **(secrets or {})}
    return {"env_vars": env}


def entrypoint(spec: JobSpec, task: str) -> str:
    require_torch_engine(spec, "--target ray")
    num_workers(spec)  # an elastic range the batch does not divide is refused before submitting
    return shlex.join(["python", "-m", ENTRYPOINT_MODULE, "--spec-json",
                       json.dumps(spec.model_dump(mode="json"), separators=(",", ":")), "--task", task])


def _client(address: str):
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError:
        raise ShardlineError("--target ray", "Ray is not installed", "pip install 'shardline[ray]'") from None
    try:
        return JobSubmissionClient(address)
    except (ConnectionError, RuntimeError) as e:
        raise ShardlineError("launch.ray.address", f"no Ray Jobs API at {address}: {e}",
                             "start the cluster (`ray start --head`) or set launch.ray.address to its "
                             "dashboard URL") from None


class RayBackend:
    """A Ray job on a running cluster, through the Jobs API."""

    target = "ray"

    def render(self, spec: JobSpec, task: str = "train") -> dict[str, str]:
        spec = resolved_for_cluster(spec)
        names = spec.launch.ray.secret_env
        secrets = f"# runtime_env env_vars also get {', '.join(names)} from the submitting shell\n" if names else ""
        return {"entrypoint.sh": f"#!/bin/sh\n{secrets}# ray job submit --address {spec.launch.ray.address} -- \\\n"
                                 f"exec {entrypoint(spec, task)}\n",
                "runtime_env.yaml": yaml.safe_dump(runtime_env(spec), sort_keys=False),
                "spec.yaml": spec_to_yaml(cluster_spec(spec))}

    def submit(self, spec: JobSpec, task: str = "train") -> LaunchRecord:
        spec = resolved_for_cluster(spec)
        secrets = from_environment(spec.launch.ray.secret_env, "launch.ray.secret_env")
        client = _client(spec.launch.ray.address)
        submission_id = f"{spec.run.id}-{uuid.uuid4().hex[:6]}"
        client.submit_job(entrypoint=entrypoint(spec, task), submission_id=submission_id,
                          runtime_env=runtime_env(spec, secrets), metadata={"shardline_run": str(spec.run.id)})
        run_dir = Path(str(spec.run.dir)) / str(spec.run.id)
        record = LaunchRecord(target=self.target, run_id=str(spec.run.id), job_id=submission_id,
                              submitted_at=datetime.now(UTC).isoformat(timespec="seconds"),
                              objects=[{"kind": "RayJobSubmission", "name": submission_id,
                                        "address": spec.launch.ray.address, "runDir": str(run_dir)}])
        save_record(run_dir, record)
        return record

    @staticmethod
    def _address(record: LaunchRecord) -> str:
        return record.objects[0]["address"]

    def status(self, record: LaunchRecord) -> JobState:
        info = _client(self._address(record)).get_job_info(str(record.job_id))
        status = str(getattr(info.status, "value", info.status))
        phase = PHASES.get(status, "unknown")
        reasons = [f"{status}: {info.message}"] if info.message and phase != "running" else []
        run_dir = Path(record.objects[0]["runDir"])
        restarts = _resumes(run_dir)
        return JobState(phase=phase, reasons=reasons, restarts=restarts)

    def logs(self, record: LaunchRecord, rank: int | None, follow: bool) -> Iterator[str]:
        """The job's output (driver and every worker, as Ray prefixes it); with a rank, that rank's log file
        in the run directory."""
        if rank is not None:
            path = Path(record.objects[0]["runDir"]) / "logs" / f"rank-{rank}.log"
            if path.is_file():
                yield from (f"[rank {rank}] {line}" for line in path.read_text().splitlines())
            return
        client, seen = _client(self._address(record)), 0
        while True:
            ended = not follow or self.status(record).phase in ("succeeded", "failed", "unknown")
            text = client.get_job_logs(str(record.job_id))
            yield from text[seen:].splitlines()
            seen = len(text)
            if ended:
                return
            time.sleep(1.0)

    def cancel(self, record: LaunchRecord) -> None:
        _client(self._address(record)).stop_job(str(record.job_id))


def _resumes(run_dir: Path) -> int:
    """Restarts Ray performed, as the run's metrics record them (one `resume` event per restart)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return 0
    return sum(1 for line in metrics.read_text().splitlines() if '"event": "resume"' in line
               or '"event":"resume"' in line)


# ---- KubeRay RayJob ---------------------------------------------------------------------------------------

RAYJOB_API = "ray.io/v1"
HEAD_RESOURCES = {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "8Gi"}}
"""The head only runs the driver and Ray's services (num-cpus/num-gpus 0: no training worker lands on it)."""
SUBMITTER_CONTAINER = "ray-job-submitter"
RAY_TOKEN_AUTH = (2, 52)
"""Ray's token authentication (RAY_AUTH_MODE=token) exists from Ray 2.52; KubeRay 1.5.1 sets it up from
`rayClusterSpec.authOptions` (https://docs.ray.io/en/latest/cluster/kubernetes/user-guides/kuberay-auth.html)."""
HEAD_NODE_LABEL = "ray.io/node-type"
"""KubeRay's label on each Ray pod: head or worker."""
# RayJob status (jobDeploymentStatus, then the Ray job's jobStatus) → the phases every backend reports.
DEPLOYMENT_PHASES = {"": "queued", "New": "queued", "Suspended": "queued", "Suspending": "queued",
                     "Waiting": "queued", "Initializing": "starting", "Running": "running", "Retrying": "starting",
                     "Complete": "succeeded", "Failed": "failed", "ValidationFailed": "failed"}


def _check_ray_version(version: str) -> None:
    if tuple(int(x) for x in version.split(".")[:2]) < RAY_TOKEN_AUTH:
        raise SpecError("launch.ray.ray_version", f"is {version}, older than Ray "
                        f"{'.'.join(map(str, RAY_TOKEN_AUTH))}, which the RayJob's token authentication needs (its "
                        "head serves the Jobs API and holds the job's secrets)", "set launch.ray.ray_version to "
                        "2.52.0 or later, and build the image with that Ray")


def head_network_policy(spec: JobSpec, name: str) -> dict:
    """Only this run's Ray pods and its submitter Job (pods labelled with the Job's name) reach the head: the
    dashboard and Jobs API on 0.0.0.0 are for them, not for every pod in the cluster. `kubectl port-forward`
    still works (it enters the pod's network namespace)."""
    from shardline.engines.kubernetes import pod as k8s_pod

    run = {"shardline.dev/run-id": name}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": f"{name}-head", "namespace": spec.launch.kubernetes.namespace,
                         "labels": k8s_pod.labels(spec)},
            "spec": {"podSelector": {"matchLabels": {**run, HEAD_NODE_LABEL: "head"}}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": {"matchLabels": run}},
                                           {"podSelector": {"matchLabels": {"batch.kubernetes.io/job-name": name}}}]}]}}


def rayjob_manifests(spec: JobSpec, task: str = "train") -> list[dict]:
    """ConfigMap with the resolved spec, a NetworkPolicy closing the head to all but the run, and a RayJob whose
    head runs the ray_train entrypoint with Ray's token authentication on.

    Pods are built by the Kubernetes launcher's helpers (image, env with the NCCL profile and secrets, volumes
    with the spec, /dev/shm and shared storage): one source of truth for what a training pod needs. Only GPU
    workers get the GPU NICs, the fabric's host paths, its RxDM sidecar, the GPU node selector and toleration;
    the head runs on the CPU pool (a head with GPU NICs could only fit a GPU node it does not tolerate)."""
    from shardline.engines.kubernetes import pod as k8s_pod
    from shardline.engines.kubernetes.objects import config_map, job_annotations, queue_labels

    num_workers(spec)
    k8s_pod.check_restart_strategy(spec, "rayjob")
    if spec.run.id is None:
        spec = spec.model_copy(deep=True)
        spec.run.id = new_run_id(spec.run.name)
    k, r = spec.launch.kubernetes, spec.launch.ray
    _check_ray_version(r.ray_version)
    for name in r.secret_env:
        if name not in k.secret_env:
            raise SpecError("launch.ray.secret_env", f"{name} would be passed from the submitting environment, but "
                            "a RayJob is submitted inside the cluster", f"store it in a Secret and set "
                            f"launch.kubernetes.secret_env.{name}: {{secret: <name>, key: <key>}}")
    name = k8s_pod.object_name(spec)
    if spec.train.engine == "maxtext":  # TPU slices running MaxText: engines/tpu/rayjob.py
        from shardline.engines.tpu.rayjob import tpu_rayjob_manifests

        cm, rayjob = tpu_rayjob_manifests(spec, r.ray_version)
        rayjob["spec"]["rayClusterSpec"]["authOptions"] = {"mode": "token"}
        return [cm, head_network_policy(spec, name), rayjob]
    cm = config_map(spec, name)
    env = k8s_pod.container_env(spec, [])
    gpu = r.gpus_per_worker > 0

    def pod(role: str, resources: dict, on_gpu: bool) -> dict:
        volumes, mounts = k8s_pod.volumes_and_mounts(spec, cm["metadata"]["name"], gpu=on_gpu)
        container = {"name": f"ray-{role}", "image": k8s_pod.image_ref(spec), "env": env, "volumeMounts": mounts,
                     "securityContext": k8s_pod.container_security(spec)}
        if resources:
            container["resources"] = resources
        if k.storage.kind != "none":
            container["workingDir"] = k.storage.mount_path
        pod_spec: dict = {"serviceAccountName": k.service_account, "securityContext": k8s_pod.POD_SECURITY,
                          "containers": [container], "volumes": volumes}
        if k.priority_class:
            pod_spec["priorityClassName"] = k.priority_class
        annotations = k8s_pod.pod_annotations(spec) if on_gpu else k8s_pod.storage_annotations(spec)
        if on_gpu:
            if sidecar := k8s_pod.rx_daemon_container(spec):
                pod_spec["initContainers"] = [sidecar]
            if node_selector := k8s_pod.node_selector(spec):
                pod_spec["nodeSelector"] = node_selector
            if tolerations := k8s_pod.tolerations(spec):
                pod_spec["tolerations"] = tolerations
        meta: dict = {"labels": k8s_pod.labels(spec)}
        if annotations:
            meta["annotations"] = annotations
        return {"metadata": meta, "spec": pod_spec}

    worker_resources = k8s_pod.resources(spec)
    if not gpu and k.gpu_resource:  # CPU workers: drop the GPU request
        worker_resources = {key: {res: v for res, v in amounts.items() if res != k.gpu_resource}
                            for key, amounts in worker_resources.items()}
        worker_resources = {key: amounts for key, amounts in worker_resources.items() if amounts}
    nodes = spec.launch.nnodes
    meta = {"name": name, "namespace": k.namespace, "labels": k8s_pod.labels(spec) | queue_labels(spec)}
    if annotations := job_annotations(spec):
        meta["annotations"] = annotations
    rayjob = {
        "apiVersion": RAYJOB_API, "kind": "RayJob", "metadata": meta,
        "spec": {
            "entrypoint": shlex.join(["python", "-m", ENTRYPOINT_MODULE, "--spec", k8s_pod.SPEC_PATH,
                                      "--task", task]),
            "runtimeEnvYAML": yaml.safe_dump(runtime_env(spec), sort_keys=False),
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 3600,
            "backoffLimit": 0,  # Ray Train restarts workers (launch.ray.max_failures); a retry would be a new cluster
            "rayClusterSpec": {
                "rayVersion": r.ray_version,
                "authOptions": {"mode": "token"},
                "headGroupSpec": {"rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0", "num-gpus": "0"},
                                  "template": pod("head", HEAD_RESOURCES, on_gpu=False)},
                "workerGroupSpecs": [{
                    "groupName": "gpu" if gpu else "cpu", "replicas": nodes,
                    "minReplicas": spec.launch.min_nnodes or nodes,
                    "maxReplicas": nodes, "rayStartParams": {}, "template": pod("worker", worker_resources, gpu)}],
            },
        },
    }
    return [cm, head_network_policy(spec, name), rayjob]


def _rayjob_ref(record: LaunchRecord) -> dict[str, str]:
    return next(o for o in record.objects if o["kind"] == "RayJob")


class RayJobBackend:
    """KubeRay RayJob through the Kubernetes API (the Kubernetes launcher's client)."""

    target = "rayjob"

    def __init__(self, api_factory=None, poll_s: float = 3.0) -> None:
        if api_factory is None:
            from shardline.engines.kubernetes.api import ClusterApi as api_factory
        self._api_factory, self.poll_s = api_factory, poll_s

    def render(self, spec: JobSpec, task: str = "train") -> dict[str, str]:
        return {"rayjob.yaml": yaml.safe_dump_all(rayjob_manifests(spec, task), sort_keys=False)}

    def submit(self, spec: JobSpec, task: str = "train") -> LaunchRecord:
        if spec.run.id is None:
            spec = spec.model_copy(deep=True)
            spec.run.id = new_run_id(spec.run.name)
        objects = rayjob_manifests(spec, task)
        create_all(self._api_factory(spec.launch.kubernetes.context), objects)  # a refused RayJob leaves no ConfigMap
        return LaunchRecord(target=self.target, run_id=spec.run.id,
                            submitted_at=datetime.now(UTC).isoformat(timespec="seconds"),
                            namespace=spec.launch.kubernetes.namespace, context=spec.launch.kubernetes.context,
                            nnodes=spec.launch.nnodes,
                            objects=[{"apiVersion": o["apiVersion"], "kind": o["kind"], "name": o["metadata"]["name"]}
                                     for o in objects])

    def status(self, record: LaunchRecord) -> JobState:
        ref = _rayjob_ref(record)
        job = self._api_factory(record.context).get(RAYJOB_API, "RayJob", record.namespace or "default", ref["name"])
        if job is None:
            return JobState(phase="unknown", reasons=[f"RayJob {ref['name']} not found (deleted or TTL expired)"])
        st = job.get("status") or {}
        deployment, ray_status = st.get("jobDeploymentStatus", ""), st.get("jobStatus", "")
        phase = DEPLOYMENT_PHASES.get(deployment, "unknown")
        if phase == "succeeded" and ray_status not in ("", "SUCCEEDED"):
            phase = "failed"  # the cluster completed its work but the Ray job did not succeed
        reasons = [f"{deployment or 'New'}" + (f", Ray job {ray_status}" if ray_status else "")
                   + (f": {st.get('reason')}" if st.get("reason") else "")
                   + (f" — {st.get('message')}" if st.get("message") else "")]
        if job.get("spec", {}).get("suspend") and phase == "queued":
            reasons.append("suspended: waiting for Kueue to admit it (launch.kubernetes.queue)")
        return JobState(phase=phase, reasons=reasons, restarts=int(st.get("failed") or 0))

    def logs(self, record: LaunchRecord, rank: int | None, follow: bool) -> Iterator[str]:
        """The Ray job's output as its submitter pod streams it (driver and every worker, Ray-prefixed);
        ranks are not separated there, so `rank` is ignored — per-rank files are in `<run dir>/logs/`."""
        api, ns, name = self._api_factory(record.context), record.namespace or "default", _rayjob_ref(record)["name"]
        while True:
            pods = api.list_pods(ns, f"job-name={name}")  # K8sJobMode: the submitter Job is named after the RayJob
            if pods or not follow or self.status(record).phase in ("succeeded", "failed", "unknown"):
                break
            time.sleep(self.poll_s)
        if pods:
            newest = max(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "")
            yield from api.pod_log(ns, newest["metadata"]["name"], SUBMITTER_CONTAINER, follow)

    def cancel(self, record: LaunchRecord) -> None:
        api = self._api_factory(record.context)
        for ref in reversed(record.objects):
            api.delete(ref["apiVersion"], ref["kind"], record.namespace or "default", ref["name"])
