"""Ray backends: the job entrypoint, the KubeRay RayJob against its CRD, and a real local Ray cluster (one head
for the module) where an elastic run under TorchTrainer loses a worker, then a node, resumes from its checkpoint each
time and finishes."""

import functools
import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import jsonschema
import pytest
import yaml

from shardline.engines.backend import wait_for
from shardline.engines.registry import get_backend
from shardline.errors import ShardlineError, SpecError
from shardline.run_status import read_status
from shardline.spec.resolve import load_spec
from tests.conftest import read_metrics, small_overrides
from tests.k8s_schemas import load_crd
from tests.launch.ray_cluster import submit_until_committed


def _strict(schema: dict) -> dict:
    """The CRD's schema with unknown fields rejected (the API server would prune them silently)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_strict(v) for v in schema]
    return schema


@functools.cache
def _rayjob_validator() -> jsonschema.Draft7Validator:
    crd = load_crd("ray.io_rayjobs")
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))


def test_ray_job_entrypoint_carries_the_resolved_spec_with_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    files = get_backend("ray").render(load_spec("tiny", ["launch.profile=a4", "run.dir=runs"]))
    cmd = shlex.split(files["entrypoint.sh"].splitlines()[-1])
    assert cmd[:4] == ["exec", "python", "-m", "shardline.engines.ray.train"] and cmd[-2:] == ["--task", "train"]
    spec = json.loads(cmd[cmd.index("--spec-json") + 1])
    assert spec["run"]["dir"] == str(tmp_path / "runs") and spec["run"]["id"].startswith("tiny-")
    env = yaml.safe_load(files["runtime_env.yaml"])["env_vars"]
    assert env["GLOO_SOCKET_IFNAME"] == "eth0" and env["LD_LIBRARY_PATH"].startswith("/usr/local/nvidia")


def test_rayjob_validates_against_the_kuberay_crd_with_gpu_worker_groups():
    spec = load_spec("llama-3.1-70b-fsdp", ["run.id=big", "launch.image=us-docker.pkg.dev/p/r/shardline:1",
                                            "launch.image_digest=sha256:" + "a" * 64, "launch.profile=a3-ultra",
                                            "launch.kubernetes.queue=team-a", "launch.ray.ray_version=2.52.0",
                                            "launch.kubernetes.storage.kind=pvc",
                                            "launch.kubernetes.storage.claim=shared"])
    configmap, _policy, rayjob = yaml.safe_load_all(get_backend("rayjob").render(spec)["rayjob.yaml"])
    _rayjob_validator().validate(rayjob)
    assert configmap["kind"] == "ConfigMap" and yaml.safe_load(configmap["data"]["spec.yaml"])["run"]["id"] == "big"
    js = rayjob["spec"]
    assert rayjob["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a" and "suspend" not in js  # Kueue's
    assert js["entrypoint"] == "python -m shardline.engines.ray.train --spec /etc/shardline/spec.yaml --task train"
    cluster = js["rayClusterSpec"]
    assert cluster["rayVersion"] == "2.52.0" and cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    group = cluster["workerGroupSpecs"][0]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == spec.launch.nnodes == 2
    pod = group["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "us-docker.pkg.dev/p/r/shardline@sha256:" + "a" * 64
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8" and c["workingDir"] == "/mnt/shardline"
    assert pod["nodeSelector"]["cloud.google.com/gke-accelerator"] == "nvidia-h200-141gb"
    assert {"name": "GLOO_SOCKET_IFNAME", "value": "eth0"} in c["env"]
    assert "networking.gke.io/interfaces" in group["template"]["metadata"]["annotations"]  # RDMA NICs per pod
    head = cluster["headGroupSpec"]["template"]["spec"]
    assert "nodeSelector" not in head and "nvidia.com/gpu" not in head["containers"][0]["resources"]["requests"]
    assert yaml.safe_load(js["runtimeEnvYAML"])["env_vars"]["LD_LIBRARY_PATH"].endswith("/usr/local/gib/lib64")


def test_rayjob_needs_an_image_and_rejects_unknown_fields_in_the_schema_check():
    with pytest.raises(SpecError, match="launch.image"):
        get_backend("rayjob").render(load_spec("tiny", ["run.id=x"]))
    rayjob = list(yaml.safe_load_all(get_backend("rayjob").render(
        load_spec("tiny", ["run.id=x", "launch.image=img:1", "launch.ray.gpus_per_worker=0"]))["rayjob.yaml"]))[2]
    assert "resources" not in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"][
        "containers"][0]
    _rayjob_validator().validate(rayjob)
    rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replica"] = 2
    with pytest.raises(jsonschema.ValidationError, match="replica"):
        _rayjob_validator().validate(rayjob)


class FakeApi:
    """The Kubernetes launcher's Api with a RayJob whose status the test sets."""

    def __init__(self):
        self.objects, self.deleted, self.status = {}, [], {}

    def __call__(self, context):
        return self

    def create(self, obj):
        self.objects[(obj["kind"], obj["metadata"]["name"])] = obj

    def get(self, api_version, kind, namespace, name):
        obj = self.objects.get((kind, name))
        return obj and {**obj, "status": self.status}

    def delete(self, api_version, kind, namespace, name):
        self.deleted.append((kind, name))

    def list_pods(self, namespace, selector):
        assert selector.startswith("job-name=")
        return [{"metadata": {"name": "submitter-abc", "creationTimestamp": "2026-01-01T00:00:00Z"}}]

    def pod_log(self, namespace, pod, container, follow):
        assert (pod, container) == ("submitter-abc", "ray-job-submitter")
        yield from ["(RayTrainWorker pid=1) step 1/8", "shardline: run x finished under Ray Train"]


def test_rayjob_submit_status_logs_and_cancel_through_the_kubernetes_api():
    from shardline.engines.ray.backend import RayJobBackend

    api = FakeApi()
    backend = RayJobBackend(api_factory=api, poll_s=0)
    record = backend.submit(load_spec("tiny", ["launch.image=img:1", "launch.ray.gpus_per_worker=0",
                                               "launch.kubernetes.queue=q"]))
    assert record.run_id.startswith("tiny-") and [o["kind"] for o in record.objects] == ["ConfigMap", "NetworkPolicy",
                                                                                         "RayJob"]
    state = backend.status(record)
    assert state.phase == "queued"
    api.status = {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}
    assert backend.status(record).phase == "running"
    api.status = {"jobDeploymentStatus": "Complete", "jobStatus": "FAILED", "reason": "AppFailed", "failed": 1}
    state = backend.status(record)
    assert state.phase == "failed" and "Ray job FAILED: AppFailed" in state.reasons[0] and state.restarts == 1
    api.status = {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}
    assert wait_for(backend, record, timeout_s=5, poll_s=0) == 0
    assert list(backend.logs(record, None, follow=True))[-1] == "shardline: run x finished under Ray Train"
    backend.cancel(record)
    assert api.deleted == [(o["kind"], o["name"]) for o in reversed(record.objects)]


# ---- a real Ray cluster on loopback -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    import ray.dashboard.modules.job  # noqa: F401  ray[default,train], in the test extra: missing fails, never skips
    import ray.train  # noqa: F401

    from tests.launch.ray_cluster import RayHead

    with RayHead(tmp_path_factory.mktemp("ray")) as head:
        yield head


def _train_workers(head) -> list[int]:
    """PIDs of this cluster's Ray Train worker actors (in the session our head started)."""
    out = subprocess.run(["ps", "-eo", "pid=,sess=,args="], capture_output=True, text=True).stdout
    pids = []
    for line in out.splitlines():
        pid, sess, args = line.split(None, 2)
        if int(sess) == head.proc.pid and args.startswith("ray::RayTrainWorker"):
            pids.append(int(pid))
    return pids


def _events(run: Path, name: str) -> list[dict]:
    return [e for e in read_metrics(run, "event") if e["event"] == name]


def _trained_after_a_resume(run: Path) -> bool:
    """The restarted group resumed and then trained a step."""
    resumes = _events(run, "resume")
    return bool(resumes) and any(r["time"] > resumes[0]["time"] for r in read_metrics(run, "train"))


@pytest.mark.slow
def test_ray_train_loses_a_worker_then_a_node_resumes_each_time_and_finishes(ray_head, session_dir, prepared,
                                                                             tmp_path):
    """One elastic run (launch.min_nnodes=1 of 2) on the module's head and a second node (two CPUs each, two per
    worker: one worker per node): a killed worker process costs a restart at the same size, 2; the second node
    killed outright costs one at the size the cluster still fits, 1. Each resumes from the last checkpoint."""
    from tests.launch.ray_cluster import RayNode

    with RayNode(ray_head, cpus=2) as node:
        spec = load_spec("tiny", [*small_overrides(session_dir / "runs"), f"run.dir={tmp_path / 'runs'}",
                                  "launch.nnodes=2", "launch.min_nnodes=1", "parallel.nproc_per_node=1",
                                  f"launch.ray.address={ray_head.address}", "launch.ray.gpus_per_worker=0",
                                  "launch.ray.cpus_per_worker=2", "launch.ray.max_failures=2",
                                  "observe.metrics_port=null", "train.max_steps=24", "checkpoint.every_steps=3"])
        backend, record, run = submit_until_committed(spec, step=3, timeout=300)
        assert [e["world"] for e in _events(run, "setup")] == [2]  # both nodes
        victims = _train_workers(ray_head)
        assert len(victims) == 1, victims  # the other worker is the second node's
        os.kill(victims[0], signal.SIGKILL)
        deadline = time.monotonic() + 300
        while not _trained_after_a_resume(run):
            assert time.monotonic() < deadline and backend.status(record).phase == "running", \
                "\n".join(backend.logs(record, None, False))[-4000:]
            time.sleep(0.2)
        node.kill()
        code = wait_for(backend, record, timeout_s=400, poll_s=1)
        logs = "\n".join(backend.logs(record, None, False))
    assert code == 0, logs[-5000:]
    resumes = _events(run, "resume")
    assert [e["world"] for e in resumes] == [2, 1] and 3 <= resumes[0]["step"] <= resumes[1]["step"], resumes
    assert [e["world"] for e in _events(run, "setup")] == [2, 2, 1]
    assert {r["step"] for r in read_metrics(run, "train")} == set(range(1, 25))
    assert json.loads((run / "manifest.json").read_text())["status"] == "finished"
    state = backend.status(record)
    assert state.phase == "succeeded" and state.restarts == len(resumes)
    assert "finished under Ray Train" in logs
    goodput = read_status(run).goodput  # each Ray Train restart is an attempt with its recovery time
    assert len(goodput.attempts) == 1 + len(resumes) and goodput.attempts[-1].ended_by == "finished"
    assert all(a.recovery_s > 0 for a in goodput.attempts[1:])
    assert sum(goodput.buckets.values()) == pytest.approx(goodput.wall_s, rel=0.01)
    print(f"ray: lost a worker (recovery {goodput.attempts[1].recovery_s:.1f} s), then a node (recovery "
          f"{goodput.attempts[2].recovery_s:.1f} s); {goodput.line()}")
    assert any(line.startswith("[rank 1]") for line in backend.logs(record, 1, False))


def test_ray_secrets_are_rendered_by_name_only_and_a_missing_one_is_named_before_submitting(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret-value-5d1e")
    spec = load_spec("tiny", [f"run.dir={tmp_path}", "launch.ray.secret_env=[HF_TOKEN]"])
    files = get_backend("ray").render(spec)
    assert "HF_TOKEN" in files["entrypoint.sh"] and "HF_TOKEN" not in yaml.safe_load(files["runtime_env.yaml"])[
        "env_vars"]
    assert all("hf_secret-value-5d1e" not in text for text in files.values())
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr("shardline.engines.ray.backend._client",
                        lambda address: pytest.fail("submitted without HF_TOKEN"))
    with pytest.raises(ShardlineError) as e:
        get_backend("ray").submit(spec)
    assert e.value.where == "launch.ray.secret_env" and "HF_TOKEN" in e.value.problem
    # a RayJob is submitted inside the cluster: its secrets come from Kubernetes Secrets
    with pytest.raises(SpecError, match="launch.kubernetes.secret_env.HF_TOKEN"):
        get_backend("rayjob").render(load_spec("tiny", ["launch.image=img:1", "launch.ray.secret_env=[HF_TOKEN]"]))
    get_backend("rayjob").render(load_spec("tiny", ["launch.image=img:1", "launch.ray.secret_env=[HF_TOKEN]",
                                                    "launch.kubernetes.secret_env.HF_TOKEN.secret=hf",
                                                    "launch.kubernetes.secret_env.HF_TOKEN.key=token"]))


@pytest.mark.slow
def test_ray_secret_env_reaches_the_jobs_tasks_and_no_file_in_the_run_holds_it(ray_head, tmp_path, monkeypatch):
    """A real Ray job whose driver and one remote task print the variable submit() copied into runtime_env."""
    token = "hf_secret-value-c0ffee"
    monkeypatch.setenv("HF_TOKEN", token)
    probe = ("import os, ray; ray.init(); task = ray.remote(num_cpus=0)(lambda: os.environ.get('HF_TOKEN')); "
             "print('driver', os.environ.get('HF_TOKEN'), 'task', ray.get(task.remote()))")
    monkeypatch.setattr("shardline.engines.ray.backend.entrypoint",
                        lambda spec, task: shlex.join(["python", "-c", probe]))
    spec = load_spec("tiny", ["run.id=r1", f"run.dir={tmp_path / 'runs'}", f"launch.ray.address={ray_head.address}",
                              "launch.ray.secret_env=[HF_TOKEN]"])
    backend = get_backend("ray")
    record = backend.submit(spec)
    code = wait_for(backend, record, timeout_s=120, poll_s=0.5)
    logs = "\n".join(backend.logs(record, None, False))
    assert code == 0 and f"driver {token} task {token}" in logs, logs[-3000:]
    written = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()]
    assert written and all(token.encode() not in p.read_bytes() for p in written)


def test_the_ray_entrypoint_names_a_bad_spec_field_instead_of_a_traceback(capsys):
    from shardline.engines.ray.train import main as ray_train_main

    spec = load_spec("tiny", ["run.id=tiny-1"]).model_dump(mode="json")
    spec["train"]["no_such_knob"] = 1
    assert ray_train_main(["--spec-json", json.dumps(spec)]) == 2
    err = capsys.readouterr().err
    assert "train.no_such_knob" in err and "--spec-json" in err and "Traceback" not in err
