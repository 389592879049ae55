"""Rendered Kubernetes objects: strict schema validity, every launch.kubernetes field visible, status in plain words."""

from __future__ import annotations

import json

import pytest
import yaml

from shardline.engines.backend import LaunchRecord, wait_for
from shardline.engines.kubernetes.backend import KubernetesBackend
from shardline.engines.kubernetes.objects import render_objects
from shardline.engines.kubernetes.status import explain
from shardline.errors import SpecError
from shardline.spec.resolve import load_spec
from tests.k8s_schemas import validate, validate_all

BASE = ["run.id=demo-20261122-000000", "launch.image=registry.example/shardline:1", "launch.nnodes=2",
        "parallel.nproc_per_node=8", "train.global_batch_size=16", "train.micro_batch_size=1",
        "launch.kubernetes.storage.kind=gcsfuse", "launch.kubernetes.storage.bucket=my-bucket"]


def _render(target: str, *extra: str) -> list[dict]:
    return render_objects(load_spec("tiny", [*BASE, *extra]), target)


def _pod(objs: list[dict]) -> dict:
    work = objs[-1]
    if work["kind"] == "Job":
        return work["spec"]["template"]
    return work["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]


@pytest.mark.parametrize("target", ["k8s-job", "jobset", "trainjob"])
def test_every_target_validates_strictly_with_all_options(target):
    pod_priority = [] if target == "trainjob" else ["launch.kubernetes.priority_class=train"]  # refused there
    objs = _render(target, "launch.profile=a4", "launch.kubernetes.queue=team-a",
                   "launch.kubernetes.workload_priority_class=high", *pod_priority,
                   "launch.kubernetes.max_run_seconds=7200",
                   "launch.kubernetes.topology=cloud.google.com/gce-topology-block",
                   "launch.kubernetes.cpu=200", "launch.kubernetes.memory=1800Gi",
                   "launch.image_digest=sha256:" + "b" * 64)
    validate_all(objs)
    work = objs[-1]
    assert work["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert work["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "high"
    assert work["metadata"]["annotations"]["provreq.kueue.x-k8s.io/maxRunDurationSeconds"] == "7200"
    assert "suspend" not in work["spec"]  # Kueue owns it
    text = yaml.safe_dump(objs)
    assert "registry.example/shardline@sha256:" + "b" * 64 in text
    assert "/usr/local/gib/scripts/set_nccl_env.sh" in text  # gIB's tuning comes from Google's script


def test_a_typo_in_a_rendered_field_fails_validation():
    job = _render("k8s-job")[-1]
    job["spec"]["template"]["spec"]["containers"][0]["imagex"] = "oops"
    with pytest.raises(Exception, match="imagex"):
        validate(job)
    js = _render("jobset")[-1]
    js["spec"]["replicatedJob"] = []
    with pytest.raises(Exception, match="replicatedJob"):
        validate(js)


def test_pod_spec_carries_the_kubernetes_settings():
    objs = _render("jobset", "launch.kubernetes.namespace=ml", "launch.kubernetes.service_account=trainer",
                   "launch.kubernetes.priority_class=urgent", "launch.kubernetes.node_selector.pool=a",
                   "launch.kubernetes.shm_size=32Gi", "launch.kubernetes.secret_env.HF_TOKEN.secret=hf",
                   "launch.kubernetes.secret_env.HF_TOKEN.key=token", "launch.kubernetes.topology=rack",
                   "launch.kubernetes.topology_mode=required", "launch.grace_seconds=90")
    pod = _pod(objs)
    spec = pod["spec"]
    assert all(o["metadata"]["namespace"] == "ml" for o in objs)
    assert spec["serviceAccountName"] == "trainer" and spec["automountServiceAccountToken"] is False
    assert spec["priorityClassName"] == "urgent" and spec["nodeSelector"]["pool"] == "a"
    assert spec["terminationGracePeriodSeconds"] == 120
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    c = spec["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in c["env"]
    assert "hf" not in json.dumps([e.get("value") for e in c["env"]])
    assert next(v for v in spec["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"] == "32Gi"
    assert pod["metadata"]["annotations"]["kueue.x-k8s.io/podset-required-topology"] == "rack"
    assert pod["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"
    assert c["workingDir"] == "/mnt/shardline"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9405"


def test_profiles_and_networks_shape_the_multi_nic_annotation():
    ann = _pod(_render("k8s-job", "launch.profile=a3-mega",
                       *[f"launch.kubernetes.gpu_networks=[{','.join(f'n{i}' for i in range(8))}]"]))["metadata"]
    nics = json.loads(ann["annotations"]["networking.gke.io/interfaces"])
    assert [n["network"] for n in nics] == ["default", *[f"n{i}" for i in range(8)]]
    with pytest.raises(SpecError, match="gpu_networks"):
        _render("k8s-job", "launch.profile=a4", "launch.kubernetes.gpu_networks=[a,b]")


@pytest.mark.parametrize("profile, added", [("a4", ["IPC_LOCK"]), ("a3-ultra", ["IPC_LOCK"]), ("a3-mega", None),
                                            ("a3-high", ["IPC_LOCK"]), ("generic", None)])
def test_trainer_containers_add_only_the_capabilities_their_fabric_needs(profile, added):
    """RDMA registers memory with the NIC (IPC_LOCK); the A3 High workload of container-engine-accelerators
    gpudirect-tcpx/nccl-test-latest.yaml adds IPC_LOCK too; A3 Mega's (gpudirect-tcpxo/nccl-test-latest.yaml) none.
    TCPX(O) profiles cannot run as a TrainJob (their sidecar), so that target is left out for them."""
    targets = ("k8s-job", "jobset") if profile.startswith("a3-") and profile != "a3-ultra" else (
        "k8s-job", "jobset", "trainjob")
    for target in targets:
        objs = _render(target, f"launch.profile={profile}")
        validate_all(objs)
        work = objs[-1]
        if target == "trainjob":
            patch = work["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
            container = patch["template"]["spec"]["template"]["spec"]["containers"][0]
        else:
            container = _pod(objs)["spec"]["containers"][0]
        caps = container["securityContext"]["capabilities"]
        assert caps["drop"] == ["ALL"] and caps.get("add") == added, (target, caps)


def test_the_trainer_container_names_its_metrics_port_for_the_pod_monitoring():
    container = _pod(_render("jobset", "observe.metrics_port=9410"))["spec"]["containers"][0]
    assert container["ports"] == [{"name": "metrics", "containerPort": 9410, "protocol": "TCP"}]
    for off in ("observe.metrics_port=null", "observe.metrics_port=0"):  # 0: a free port, nothing to declare
        assert "ports" not in _pod(_render("k8s-job", off))["spec"]["containers"][0]


def test_two_runs_of_one_name_get_distinct_objects_and_the_rank0_address():
    a, b = _render("k8s-job"), _render("k8s-job", "run.id=demo-20261122-000001")
    assert a[-1]["metadata"]["name"] != b[-1]["metadata"]["name"]
    env = {e["name"]: e for e in _pod(a)["spec"]["containers"][0]["env"]}
    assert env["PET_MASTER_ADDR"]["value"] == "demo-20261122-000000-0.demo-20261122-000000"
    assert env["PET_MASTER_PORT"]["value"] == "29500"
    trainer_env = {e["name"] for e in _render("trainjob")[-1]["spec"]["trainer"]["env"]}
    assert not any(n.startswith("PET_") for n in trainer_env)  # Trainer injects and reserves them


def test_storage_and_spec_errors_name_the_field():
    with pytest.raises(SpecError, match="storage.kind"):
        _render("jobset", "launch.kubernetes.storage.kind=none")
    with pytest.raises(SpecError, match="storage.claim"):
        _render("jobset", "launch.kubernetes.storage.kind=pvc")
    with pytest.raises(SpecError, match="launch.image"):
        _render("jobset", "launch.image=null")
    with pytest.raises(SpecError, match="max_run_seconds"):
        _render("jobset", "launch.kubernetes.max_run_seconds=600")
    pvc = _pod(_render("jobset", "launch.kubernetes.storage.kind=pvc", "launch.kubernetes.storage.claim=shared",
                       "launch.kubernetes.storage.read_path=/weights"))["spec"]
    assert {"name": "storage-read", "mountPath": "/weights", "readOnly": True} in pvc["containers"][0]["volumeMounts"]


def _pod_obj(index: int, status: dict, created: str = "2026-11-22T00:00:00Z") -> dict:
    return {"metadata": {"name": f"p{index}-{created[-3:-1]}", "creationTimestamp": created,
                         "annotations": {"batch.kubernetes.io/job-completion-index": str(index)}}, "status": status}


def test_status_explains_queue_capacity_and_scheduling_in_plain_words():
    work = {"spec": {"suspend": True}, "status": {}}
    workload = {"status": {"conditions": [
        {"type": "QuotaReserved", "status": "False",
         "message": "couldn't assign flavors to pod set node: insufficient unused quota for nvidia.com/gpu"}],
        "admissionChecks": [{"name": "dws-prov", "state": "Pending",
                             "message": "Waiting for resources. Currently there are not enough resources"}]}}
    state = explain(work, [], workload, 2)
    assert state.phase == "queued"
    text = " ".join(state.reasons)
    assert "suspended" in text and "quota exhausted" in text and "waiting for capacity" in text
    pods = [_pod_obj(0, {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False",
                 "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]}),
            _pod_obj(1, {"phase": "Pending", "containerStatuses": [
                {"state": {"waiting": {"reason": "ImagePullBackOff", "message": "not found"}}}]})]
    state = explain({"status": {}}, pods, None, 2)
    assert state.phase == "starting"
    assert "not enough resources" in state.reasons[0] and "image pull error" in state.reasons[1]


def test_status_counts_restarts_and_reads_exit_codes():
    pods = [_pod_obj(0, {"phase": "Failed", "containerStatuses": [{"state": {"terminated": {"exitCode": 75}}}]},
                     "2026-11-22T00:00:01Z"),
            _pod_obj(0, {"phase": "Running", "containerStatuses": [{"state": {"running": {}}}]},
                     "2026-11-22T00:00:09Z"),
            _pod_obj(1, {"phase": "Running", "containerStatuses": [{"state": {"running": {}}}]})]
    state = explain({"status": {"restarts": 1}}, pods, None, 2)
    assert state.phase == "running" and state.restarts == 1
    assert [r.restarts for r in state.ranks] == [1, 0]
    failed = explain({"status": {"conditions": [{"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
                                                  "message": "exit code 2"}]}}, [], None, 2)
    assert failed.phase == "failed" and "PodFailurePolicy" in failed.reasons[0]


class RecordedApi:
    """The launcher's API interface over recorded objects (no API server can run on these machines)."""

    def __init__(self, phases: list[dict]):
        self.phases, self.created, self.deleted = phases, [], []

    def create(self, obj):
        self.created.append(obj)

    def get(self, api_version, kind, namespace, name):
        return self.phases.pop(0) if len(self.phases) > 1 else self.phases[0]

    def delete(self, api_version, kind, namespace, name):
        self.deleted.append((kind, name))

    def list_pods(self, namespace, selector):
        return [_pod_obj(0, {"phase": "Running", "containerStatuses": [{"state": {"running": {}}}]})]

    def list_workloads(self, namespace):
        return []

    def pod_log(self, namespace, pod, container, follow):
        yield from ["step 1 loss 7.1", "step 2 loss 6.2"]


def test_submit_wait_logs_and_cancel_through_the_api_interface():
    done = {"status": {"conditions": [{"type": "Completed", "status": "True"}]}}
    api = RecordedApi([{"status": {}}, done])
    backend = KubernetesBackend("jobset", api_factory=lambda ctx: api, poll_s=0)
    spec = load_spec("tiny", [*BASE, "launch.nnodes=1"])
    record = backend.submit(spec)
    assert [o["kind"] for o in api.created] == ["ConfigMap", "JobSet"]
    assert wait_for(backend, record, timeout_s=5, poll_s=0) == 0
    assert list(backend.logs(record, rank=None, follow=False)) == ["[rank 0] step 1 loss 7.1",
                                                                     "[rank 0] step 2 loss 6.2"]
    backend.cancel(record)
    assert api.deleted == [("JobSet", record.objects[1]["name"]), ("ConfigMap", record.objects[0]["name"])]
    running = KubernetesBackend("jobset", api_factory=lambda ctx: RecordedApi([{"status": {}}]), poll_s=0)
    assert wait_for(running, LaunchRecord.model_validate(record.model_dump()), timeout_s=0.05, poll_s=0.01) == 124


@pytest.mark.parametrize("target", ["k8s-job", "jobset", "trainjob"])
@pytest.mark.parametrize("override", ["run.id=My_Run", "run.id=run_1"])
def test_a_run_id_that_cannot_name_kubernetes_objects_is_refused_by_name(target, override):
    from shardline.engines.registry import get_backend

    spec = load_spec("tiny", [override, "launch.image=img:1"])
    with pytest.raises(SpecError) as refused:
        get_backend(target).render(spec)
    assert refused.value.field == override.split("=")[0] and "cannot name Kubernetes objects" in refused.value.problem


@pytest.mark.parametrize("target", ["k8s-job", "jobset", "trainjob"])
@pytest.mark.parametrize("objective", ["dpo", "grpo"])
def test_every_target_ships_a_post_training_objective_in_the_spec_the_workers_read(target, objective):
    objs = _render(target, f"train.objective={objective}", "train.grpo.num_generations=2", "train.global_batch_size=32")
    validate_all(objs)
    (config,) = [o for o in objs if o["kind"] == "ConfigMap" and "spec.yaml" in o.get("data", {})]
    shipped = yaml.safe_load(config["data"]["spec.yaml"])
    assert shipped["train"]["objective"] == objective
    assert shipped["train"]["grpo"]["num_generations"] == 2
