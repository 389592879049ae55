"""What each Kubernetes target does with the spec: an elastic job's rendezvous reaches rank 0's pod through the
DNS names the rendered objects create, and a TrainJob carries every pod setting or refuses it by name."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardline.engines.kubernetes.objects import render_objects
from shardline.errors import SpecError
from shardline.spec.resolve import load_spec
from tests.k8s_schemas import validate_all
from tests.launch.k8s_pods import pods_from

BASE = ["run.id=el-20261122-000000", "launch.image=registry.example/shardline:1", "launch.nnodes=4",
        "parallel.nproc_per_node=8", "train.global_batch_size=96", "train.micro_batch_size=1",
        "launch.kubernetes.storage.kind=gcsfuse", "launch.kubernetes.storage.bucket=my-bucket"]
ELASTIC = [*BASE, "launch.min_nnodes=2"]
TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"  # where the API server mounts a pod's token


def _render(target: str, *overrides: str) -> list[dict]:
    objs = render_objects(load_spec("tiny", list(overrides)), target)
    validate_all(objs)
    return objs


def _template(work: dict) -> dict:
    if work["kind"] == "Job":
        return work["spec"]["template"]
    return work["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]


def _flag(command: list[str], name: str) -> str | None:
    values = [a.split("=", 1)[1] for a in command if a.startswith(f"{name}=")]
    assert len(values) <= 1, command
    return values[0] if values else None


@pytest.mark.parametrize("target", ["k8s-job", "jobset"])
def test_elastic_pods_rendezvous_at_rank0_through_the_dns_name_the_rendered_objects_create(target):
    objs = _render(target, *ELASTIC)
    work = objs[-1]
    pod = _template(work)["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    if target == "k8s-job":  # pod `<job>-<index>` under the subdomain of a headless Service selecting the Job
        service = next(o for o in objs if o["kind"] == "Service")
        assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
        assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": work["metadata"]["name"]}
        port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "rendezvous")
    else:  # JobSet's `<jobset>-<replicatedJob>-<job index>-<pod index>` under its network subdomain
        assert work["spec"]["network"]["enableDNSHostnames"] is True
        port = int(env["PET_MASTER_PORT"])
    rank0 = pods_from(objs)[0]
    assert rank0.index == 0
    assert _flag(container["command"], "--rdzv-endpoint") == f"{rank0.fqdn}:{port}"
    assert _flag(container["command"], "--rdzv-backend") == "c10d"
    assert _flag(container["command"], "--nnodes") == "2:4"
    assert env["PET_MASTER_ADDR"] == rank0.fqdn  # the host wait_rendezvous waits for before torchrun starts


def test_a_fixed_size_job_has_no_rendezvous_endpoint_flag():
    command = _template(_render("jobset", *BASE)[-1])["spec"]["containers"][0]["command"]
    assert _flag(command, "--rdzv-endpoint") is None and _flag(command, "--nnodes") == "4"


def test_trainjob_refuses_an_elastic_job_by_name():
    with pytest.raises(SpecError) as e:
        render_objects(load_spec("tiny", ELASTIC), "trainjob")
    assert e.value.where == "launch.min_nnodes"
    assert "trainjob" in e.value.problem and "jobset" in e.value.fix


def test_trainjob_refuses_a_pod_priority_class_it_cannot_set():
    with pytest.raises(SpecError) as e:
        render_objects(load_spec("tiny", [*BASE, "launch.kubernetes.priority_class=urgent"]), "trainjob")
    assert e.value.where == "launch.kubernetes.priority_class" and "'urgent'" in e.value.problem
    assert "trainjob" in e.value.problem
    assert "jobset" in e.value.fix and "workload_priority_class" in e.value.fix
    assert _template(_render("jobset", *BASE, "launch.kubernetes.priority_class=urgent")[-1])["spec"][
        "priorityClassName"] == "urgent"


def _trainjob_parts(objs: list[dict]) -> tuple[dict, dict]:
    tj = objs[-1]
    patch = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    return tj["spec"]["trainer"], patch["template"]["spec"]["template"]["spec"]


def test_trainjob_carries_every_setting_of_the_pod_the_other_targets_run():
    settings = [*BASE, "launch.kubernetes.service_account=trainer", "launch.kubernetes.node_selector.pool=a",
                "launch.kubernetes.cpu=100", "launch.kubernetes.secret_env.HF_TOKEN.secret=hf",
                "launch.kubernetes.secret_env.HF_TOKEN.key=token", "launch.grace_seconds=90"]
    pod = _template(_render("jobset", *settings)[-1])["spec"]
    trainer, patched = _trainjob_parts(_render("trainjob", *settings))
    node, patched_node = pod["containers"][0], patched["containers"][0]
    for key in ("serviceAccountName", "securityContext", "terminationGracePeriodSeconds", "nodeSelector",
                "tolerations"):
        assert patched[key] == pod[key], key
    assert all(v in patched["volumes"] for v in pod["volumes"])
    assert trainer["image"] == node["image"]
    assert trainer["env"] == [e for e in node["env"] if not e["name"].startswith("PET_")]  # Trainer injects PET_*
    assert trainer["resourcesPerNode"] == node["resources"]
    assert patched_node["securityContext"] == node["securityContext"]
    assert all(m in patched_node["volumeMounts"] for m in node["volumeMounts"])
    # The two without a patch field: the working directory and no API token in the trainer container.
    assert trainer["command"][trainer["command"].index("--chdir") + 1] == node["workingDir"]
    assert trainer["command"][trainer["command"].index("--"):] == node["command"][node["command"].index("--"):]
    assert pod["automountServiceAccountToken"] is False
    token_mount = next(m for m in patched_node["volumeMounts"] if m["mountPath"] == TOKEN_PATH)
    volume = next(v for v in patched["volumes"] if v["name"] == token_mount["name"])
    assert set(volume) == {"name", "emptyDir"} and not volume["name"].startswith("kube-api-access-")
    assert token_mount["readOnly"] is True


def test_trainjob_node_command_runs_in_the_storage_directory(tmp_path):
    trainer, _ = _trainjob_parts(_render("trainjob", *BASE, "launch.kubernetes.storage.kind=pvc",
                                         "launch.kubernetes.storage.claim=shared",
                                         f"launch.kubernetes.storage.mount_path={tmp_path}"))
    command = trainer["command"]
    wrapper = [sys.executable if a == "python" else a for a in command[:command.index("--") + 1]]
    out = subprocess.run([*wrapper, sys.executable, "-c", "import os; print(os.getcwd())"], cwd="/",
                         capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path)
