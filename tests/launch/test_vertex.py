"""Vertex AI (`--target vertex`): the CustomJob a spec renders, checked by the aiplatform_v1 types, and
engines/status/wait/cancel/logs through the real JobServiceClient against a local JobService (vertex_api.py)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import yaml
from google.cloud import aiplatform_v1

from shardline.engines.backend import LaunchRecord, wait_for
from shardline.engines.registry import get_backend
from shardline.engines.vertex.backend import VertexBackend
from shardline.engines.vertex.job import custom_job, run_dir_url
from shardline.errors import ClusterError, ShardlineError, SpecError
from shardline.spec.resolve import load_spec
from tests.launch.vertex_api import VertexApi

DIGEST = "sha256:" + "ab" * 32
BASE = ["run.id=vx-1", "launch.image=us-docker.pkg.dev/p/repo/shardline:0.1", f"launch.image_digest={DIGEST}",
        "launch.vertex.output_dir=gs://my-bucket/shardline/", "launch.vertex.project=my-proj"]
GPU = ["launch.profile=a3-mega", "parallel.nproc_per_node=8", "launch.nnodes=4", "train.global_batch_size=256"]
CPU = ["launch.vertex.machine_type=n2-standard-8", "parallel.nproc_per_node=2", "train.global_batch_size=16"]


def _spec(*extra: str, base: list[str] = BASE):
    return load_spec("tiny", [*base, *extra])


def _render(*extra: str) -> tuple[str, dict]:
    text = get_backend("vertex").render(_spec(*extra))["custom-job.json"]
    return text, json.loads(text)


def _env(pool: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pool["containerSpec"]["env"]}


# --- render -------------------------------------------------------------------------------------------------------

def test_custom_job_has_the_primary_alone_in_pool_0_and_the_other_nodes_in_pool_1():
    text, job = _render(*GPU)
    parsed = aiplatform_v1.CustomJob.from_json(text, ignore_unknown_fields=False)  # the upstream schema, strictly
    assert json.loads(aiplatform_v1.CustomJob.to_json(parsed, use_integers_for_enums=False,
                                                      always_print_fields_with_no_presence=False)) == job
    pools = job["jobSpec"]["workerPoolSpecs"]
    assert [p["replicaCount"] for p in pools] == ["1", "3"]
    assert pools[0]["machineSpec"] == pools[1]["machineSpec"] == {
        "machineType": "a3-megagpu-8g", "acceleratorType": "NVIDIA_H100_MEGA_80GB", "acceleratorCount": 8}
    assert pools[0]["containerSpec"] == pools[1]["containerSpec"]
    container = pools[0]["containerSpec"]
    assert container["imageUri"] == f"us-docker.pkg.dev/p/repo/shardline@{DIGEST}"
    command = container["command"]
    assert command[:10] == ["python", "-m", "shardline.engines.vertex.entry", "--workdir", "/gcs/my-bucket/shardline",
                            "--spec", "/tmp/shardline/spec.yaml", "--nnodes", "4", "--"]
    assert command[10:14] == ["python", "-m", "shardline.engines.torchrun", "--nnodes=4"]
    assert command[-6:] == ["-m", "shardline.worker", "--spec", "/tmp/shardline/spec.yaml", "--task", "train"]
    env = _env(pools[0])
    shipped = yaml.safe_load(env["SHARDLINE_SPEC"])  # the resolved spec, as the cluster launchers ship it
    assert shipped["run"]["id"] == "vx-1" and shipped["observe"]["metrics_host"] == "0.0.0.0"
    assert env["SHARDLINE_IMAGE_DIGEST"] == DIGEST and env["SHARDLINE_IMAGE"] == container["imageUri"]
    assert "NCCL_FASTRAK_NUM_FLOWS" not in env  # GKE's TCPXO settings point at host libraries Vertex does not have
    assert job["displayName"] == "vx-1"
    assert job["labels"]["shardline-run-id"] == "vx-1" and job["labels"]["shardline-run-name"] == "tiny"
    assert len(job["labels"]["shardline-spec-hash"]) == 16
    assert job["jobSpec"]["baseOutputDirectory"] == {"outputUriPrefix": "gs://my-bucket/shardline"}
    assert job["jobSpec"]["scheduling"] == {"restartJobOnWorkerRestart": True, "strategy": "STANDARD"}


@pytest.mark.parametrize("profile,machine", [("a3-high", "a3-highgpu-8g"), ("a3-mega", "a3-megagpu-8g"),
                                             ("a3-ultra", "a3-ultragpu-8g"), ("a4", "a4-highgpu-8g")])
def test_each_gpu_profile_renders_its_machine_with_an_accelerator_vertex_knows(profile, machine):
    _, job = _render(*GPU, f"launch.profile={profile}", "launch.nnodes=1", "train.global_batch_size=64")
    spec = job["jobSpec"]["workerPoolSpecs"][0]["machineSpec"]
    assert spec["machineType"] == machine and spec["acceleratorCount"] == 8
    assert spec["acceleratorType"] in aiplatform_v1.AcceleratorType.__members__
    assert len(job["jobSpec"]["workerPoolSpecs"]) == 1


@pytest.mark.parametrize("extra,scheduling", [
    ([], {"strategy": "STANDARD"}),
    (["cost.provisioning=spot"], {"strategy": "SPOT"}),
    (["cost.provisioning=dws-flex-start"], {"strategy": "FLEX_START"}),
    (["cost.provisioning=dws-flex-start", "launch.vertex.max_wait_seconds=7200"],
     {"strategy": "FLEX_START", "maxWaitDuration": "7200s"}),
    (["launch.vertex.max_run_seconds=86400"], {"strategy": "STANDARD", "timeout": "86400s"}),
    (["cost.provisioning=reservation", "launch.vertex.reservation=projects/p/zones/us-central1-a/reservations/r1"], {}),
])
def test_provisioning_chooses_the_scheduling_strategy(extra, scheduling):
    _, job = _render(*GPU, "launch.vertex.restart_job_on_worker_restart=false", *extra)
    assert job["jobSpec"].get("scheduling", {}) == scheduling


def test_a_reservation_is_named_on_every_pool():
    name = "projects/my-proj/zones/us-central1-a/reservations/r1"
    _, job = _render(*GPU, "cost.provisioning=reservation", f"launch.vertex.reservation={name}")
    for pool in job["jobSpec"]["workerPoolSpecs"]:
        assert pool["machineSpec"]["reservationAffinity"] == {
            "reservationAffinityType": "SPECIFIC_RESERVATION", "key": "compute.googleapis.com/reservation-name",
            "values": [name]}


def test_service_account_and_network_are_the_jobs():
    _, job = _render(*GPU, "launch.vertex.service_account=trainer@my-proj.iam.gserviceaccount.com",
                     "launch.vertex.network=projects/123456/global/networks/vpc-1")
    assert job["jobSpec"]["serviceAccount"] == "trainer@my-proj.iam.gserviceaccount.com"
    assert job["jobSpec"]["network"] == "projects/123456/global/networks/vpc-1"


def test_secrets_travel_as_secret_manager_names_never_as_values(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_the_value")
    text, job = _render(*GPU, "launch.vertex.secret_env.HF_TOKEN=hf-token",
                        "launch.vertex.secret_env.WANDB_API_KEY=projects/other/secrets/wandb/versions/3",
                        "launch.kubernetes.secret_env.HF_TOKEN.secret=hf",
                        "launch.kubernetes.secret_env.HF_TOKEN.key=t")
    assert json.loads(_env(job["jobSpec"]["workerPoolSpecs"][1])["SHARDLINE_SECRETS"]) == {
        "HF_TOKEN": "projects/my-proj/secrets/hf-token/versions/latest",
        "WANDB_API_KEY": "projects/other/secrets/wandb/versions/3"}
    assert "hf_the_value" not in text


def test_the_generic_profile_takes_the_machine_from_the_vertex_section():
    _, job = _render(*CPU)
    assert job["jobSpec"]["workerPoolSpecs"][0]["machineSpec"] == {"machineType": "n2-standard-8"}
    _, job = _render(*CPU, "launch.vertex.machine_type=g2-standard-24", "launch.vertex.accelerator=NVIDIA_L4")
    assert job["jobSpec"]["workerPoolSpecs"][0]["machineSpec"] == {
        "machineType": "g2-standard-24", "acceleratorType": "NVIDIA_L4", "acceleratorCount": 2}


@pytest.mark.parametrize("extra,field", [
    ([], "launch.vertex.machine_type"),
    ([*CPU, "launch.vertex.accelerator=NVIDIA_X100"], "launch.vertex.accelerator"),
    ([*GPU, "launch.vertex.machine_type=n2-standard-8"], "launch.vertex.machine_type"),
    ([*GPU, "parallel.nproc_per_node=4", "train.global_batch_size=128"], "parallel.nproc_per_node"),
    ([*GPU, "launch.min_nnodes=2", "train.global_batch_size=768"], "launch.min_nnodes"),
    ([*GPU, "run.dir=/scratch/runs"], "run.dir"),
    ([*GPU, "checkpoint.dir=/mnt/ckpt"], "checkpoint.dir"),
    ([*GPU, "launch.kubernetes.secret_env.HF_TOKEN.secret=hf", "launch.kubernetes.secret_env.HF_TOKEN.key=t"],
     "launch.kubernetes.secret_env"),
    ([*GPU, "launch.slurm.secret_env=[WANDB_API_KEY]"], "launch.slurm.secret_env"),
    ([*GPU, "launch.vertex.reservation=projects/p/zones/z/reservations/r"], "launch.vertex.reservation"),
    ([*GPU, "cost.provisioning=reservation"], "launch.vertex.reservation"),
    ([*GPU, "launch.vertex.max_wait_seconds=60"], "launch.vertex.max_wait_seconds"),
    ([*GPU, "cost.provisioning=dws-flex-start", "launch.vertex.max_run_seconds=700000"],
     "launch.vertex.max_run_seconds"),
    ([*GPU, "launch.vertex.project=null", "launch.vertex.secret_env.HF_TOKEN=hf-token"],
     "launch.vertex.secret_env.HF_TOKEN"),
    ([*GPU, "launch.vertex.output_dir=null"], "launch.vertex.output_dir"),
    ([*GPU, "launch.image=null"], "launch.image"),
])
def test_what_vertex_cannot_honour_is_an_error_naming_the_field(extra, field):
    with pytest.raises(SpecError) as e:
        get_backend("vertex").render(_spec(*extra))
    assert e.value.where == field and e.value.fix


@pytest.mark.parametrize("assignment,field", [("launch.vertex.output_dir=s3://b/x", "launch.vertex.output_dir"),
                                              ("launch.vertex.zone=us-central1-a", "launch.vertex.zone"),
                                              ("launch.vertex.secret_env.HF_TOKEN=a/b/c", "launch.vertex.secret_env")])
def test_the_vertex_section_rejects_bad_values_and_unknown_keys(assignment, field):
    with pytest.raises(SpecError) as e:
        load_spec("tiny", [assignment])
    assert e.value.where.startswith(field)


def test_the_run_directory_is_in_the_bucket():
    assert run_dir_url(_spec(*GPU)) == "gs://my-bucket/shardline/runs/vx-1"
    assert run_dir_url(_spec(*GPU, "run.dir=./exp")) == "gs://my-bucket/shardline/exp/vx-1"
    assert run_dir_url(_spec(*GPU, "run.dir=/gcs/other-bucket/runs")) == "gs://other-bucket/runs/vx-1"
    custom_job(_spec(*GPU, "run.dir=/gcs/other-bucket/runs", "checkpoint.dir=gs://ckpt-bucket/x"))  # accepted
    # a relative path that climbs out of the output directory lands on the replica's disk: refused by name
    for field in ("run.dir", "checkpoint.dir"):
        with pytest.raises(SpecError, match="climbs out") as e:
            custom_job(_spec(*GPU, f"{field}=exp/../../../tmp/runs"))
        assert e.value.where == field


def test_render_out_writes_custom_job_json(tmp_path):
    from shardline.cli import main

    overrides = [a for pair in zip(["--set"] * 20, [*BASE, *GPU], strict=False) for a in pair]
    assert main(["render", "tiny", "--target", "vertex", "--out", str(tmp_path), *overrides]) == 0
    text = (tmp_path / "custom-job.json").read_text()
    assert aiplatform_v1.CustomJob.from_json(text, ignore_unknown_fields=False).display_name == "vx-1"


def test_without_the_vertex_extra_the_error_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "google.cloud.aiplatform_v1", None)
    with pytest.raises(ShardlineError, match=r"shardline\[vertex\]"):
        get_backend("vertex").render(_spec(*GPU))


# --- the API: launch, status, wait, cancel, logs --------------------------------------------------------------------

@pytest.fixture
def api():
    server = VertexApi()
    yield server
    server.close()


def _launch(api: VertexApi, *extra: str) -> tuple[VertexBackend, LaunchRecord]:
    backend = VertexBackend(client_factory=api.client, poll_s=0.01)
    return backend, backend.submit(_spec(*GPU, "launch.vertex.region=europe-west4", *extra))


def test_launch_creates_the_rendered_custom_job_in_the_project_and_region(api):
    backend, record = _launch(api)
    create = api.requests[0]
    assert (create.method, create.path) == ("POST", "/v1/projects/my-proj/locations/europe-west4/customJobs")
    rendered = backend.render(_spec(*GPU, "launch.vertex.region=europe-west4"))["custom-job.json"]
    sent = aiplatform_v1.CustomJob.from_json(json.dumps(create.body), ignore_unknown_fields=False)
    assert sent == aiplatform_v1.CustomJob.from_json(rendered)
    assert api.regions == ["europe-west4"]
    assert record.target == "vertex" and record.run_id == "vx-1" and record.nnodes == 4
    assert record.job_id == "projects/my-proj/locations/europe-west4/customJobs/1000"
    assert record.objects[0]["runDir"] == "gs://my-bucket/shardline/runs/vx-1"


def test_the_cli_launches_records_and_waits_for_a_vertex_run(api, tmp_path, monkeypatch, capsys):
    from shardline.cli import main
    from shardline.engines.vertex import backend as vertex

    monkeypatch.setattr(vertex, "_default_client", api.client)  # the real client, pointed at the local JobService
    monkeypatch.chdir(tmp_path)
    api.script([("JOB_STATE_PENDING", None), ("JOB_STATE_RUNNING", None),
                ("JOB_STATE_FAILED", "The replica workerpool1-0 exited with a non-zero status of 75.")])
    sets = [a for pair in zip(["--set"] * 20, [*BASE, *GPU], strict=False) for a in pair]
    assert main(["launch", "tiny", "--target", "vertex", *sets]) == 0
    assert json.loads((tmp_path / "runs" / "vx-1" / "launch.json").read_text())["job_id"].endswith("customJobs/1000")
    assert main(["status", "vx-1"]) == 0
    assert "vx-1 (vertex): starting" in capsys.readouterr().out
    assert main(["wait", "vx-1", "--poll", "0.01"]) == 75
    assert "preempted" in capsys.readouterr().out


def test_launch_without_a_project_names_the_field(api):
    with pytest.raises(SpecError, match="launch.vertex.project"):
        _launch(api, "launch.vertex.project=null")
    assert api.requests == []


@pytest.mark.parametrize("state,error,phase,words", [
    ("JOB_STATE_QUEUED", None, "queued", "queued"),
    ("JOB_STATE_PENDING", None, "starting", "provisioning"),
    ("JOB_STATE_RUNNING", None, "running", "running since 2026-11-25T10:05:00"),
    ("JOB_STATE_SUCCEEDED", None, "succeeded", "succeeded"),
    ("JOB_STATE_FAILED", "The replica workerpool1-0 exited with a non-zero status of 1. Termination reason: Error.",
     "failed", "exit code 1"),
    ("JOB_STATE_FAILED", "The replica workerpool0-0 exited with a non-zero status of 75. Termination reason: Error.",
     "preempted", "saving a checkpoint"),
    ("JOB_STATE_FAILED", "The replica workerpool0-0 exited with a non-zero status of 2. Termination reason: Error.",
     "failed", "bad input"),
    ("JOB_STATE_FAILED", "Resources are insufficient in region: europe-west4. Try a different region.",
     "failed", "stockout"),
    ("JOB_STATE_CANCELLED", None, "failed", "cancelled"),
    ("JOB_STATE_EXPIRED", None, "failed", "max_wait_seconds"),
])
def test_status_maps_the_job_state_to_a_phase_with_plain_reasons(api, state, error, phase, words):
    api.script([(state, error)])
    backend, record = _launch(api)
    got = backend.status(record)
    assert got.phase == phase
    assert any(words in r for r in got.reasons), got.reasons
    if error:
        assert any(error in r for r in got.reasons)
    assert api.requests[-1].method == "GET" and api.requests[-1].path == f"/v1/{record.job_id}"


def test_a_flex_start_job_that_waits_says_for_what(api):
    api.script([("JOB_STATE_PENDING", None)])
    backend, record = _launch(api, "cost.provisioning=dws-flex-start")
    assert any("Dynamic Workload Scheduler" in r for r in backend.status(record).reasons)


@pytest.mark.parametrize("last,code", [
    (("JOB_STATE_SUCCEEDED", None), 0),
    (("JOB_STATE_FAILED", "The replica workerpool0-0 exited with a non-zero status of 1."), 1),
    (("JOB_STATE_FAILED", "The replica workerpool1-2 exited with a non-zero status of 75."), 75),
    (("JOB_STATE_CANCELLED", None), 1),
])
def test_wait_follows_the_job_to_its_end_and_returns_its_exit_code(api, last, code):
    api.script([("JOB_STATE_QUEUED", None), ("JOB_STATE_PENDING", None), ("JOB_STATE_RUNNING", None), last])
    backend, record = _launch(api)
    seen: list[str] = []
    assert wait_for(backend, record, timeout_s=30, poll_s=0.01, on_change=lambda s: seen.append(s.phase)) == code
    assert seen[:3] == ["queued", "starting", "running"] and len(seen) == 4


def test_wait_times_out_with_124_while_the_job_runs(api):
    api.script([("JOB_STATE_RUNNING", None)])
    backend, record = _launch(api)
    assert wait_for(backend, record, timeout_s=0.2, poll_s=0.05) == 124


def test_cancel_asks_vertex_to_cancel_and_the_run_ends_cancelled(api):
    api.script([("JOB_STATE_RUNNING", None)])
    backend, record = _launch(api)
    backend.cancel(record)
    assert (api.requests[-1].method, api.requests[-1].path) == ("POST", f"/v1/{record.job_id}:cancel")
    assert backend.status(record).phase == "running"  # cancelling
    assert wait_for(backend, record, timeout_s=5, poll_s=0.01) == 1
    assert "cancelled" in backend.status(record).reasons[0]


def test_api_refusals_are_cluster_errors_with_a_fix(api):
    api.fail_next(403, "PERMISSION_DENIED", "Permission 'aiplatform.customJobs.create' denied")
    with pytest.raises(ClusterError, match="roles/aiplatform.user"):
        _launch(api)
    backend = VertexBackend(client_factory=api.client)
    gone = LaunchRecord(target="vertex", run_id="x", submitted_at="",
                        job_id="projects/my-proj/locations/europe-west4/customJobs/999")
    with pytest.raises(ClusterError, match="NotFound"):
        backend.status(gone)


def test_without_credentials_the_error_says_how_to_log_in(monkeypatch, tmp_path):
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(ClusterError, match="gcloud auth application-default login"):
        get_backend("vertex").status(LaunchRecord(target="vertex", run_id="x", submitted_at="",
                                                  job_id="projects/p/locations/us-central1/customJobs/1"))


def _logs_record(record: LaunchRecord, run_dir) -> LaunchRecord:
    record.objects[0]["runDir"] = str(run_dir)
    return record


def test_logs_point_to_cloud_logging_and_stream_the_rank_logs_from_the_run_directory(api, tmp_path):
    api.script([("JOB_STATE_RUNNING", None), ("JOB_STATE_RUNNING", None), ("JOB_STATE_SUCCEEDED", None)])
    backend, record = _launch(api)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank-0.log").write_text("step 1\nstep 2\n")
    (logs / "rank-1.log").write_text("step 1\npartial")
    lines = list(backend.logs(_logs_record(record, tmp_path), rank=None, follow=True))
    assert "gcloud ai custom-jobs stream-logs 1000 --region=europe-west4" in lines[0]
    assert lines[2:] == ["[rank 0] step 1", "[rank 0] step 2", "[rank 1] step 1", "[rank 1] partial"]
    assert list(backend.logs(record, rank=1, follow=False))[2:] == ["[rank 1] step 1", "[rank 1] partial"]


def test_logs_of_a_bucket_without_gcsfs_say_what_to_install(api):
    assert importlib.util.find_spec("fsspec") is not None  # s3fs's, in the test extra
    assert importlib.util.find_spec("gcsfs") is None  # the test needs the package absent
    backend, record = _launch(api)
    lines = list(backend.logs(record, rank=None, follow=False))
    assert "stream-logs" in lines[0] and "pip install gcsfs" in lines[1]


def test_plan_and_cost_use_the_gpu_of_the_vertex_accelerator_type(tmp_path):
    """A generic-profile Vertex job names its GPU only as Vertex's AcceleratorType: plan and price that GPU."""
    import shardline
    from shardline.planning.cost import plan_cost_lines

    sets = {"run.dir": str(tmp_path), "launch.vertex.machine_type": "a2-ultragpu-1g",
            "launch.vertex.accelerator": "NVIDIA_A100_80GB", "parallel.nproc_per_node": 1}
    planned = shardline.plan(shardline.Spec.load("tiny", sets))
    assert planned.device.name == "A100 80GB" and planned.device.kind == "cuda"
    lines = plan_cost_lines(shardline.Spec.load("tiny", sets), planned.device.kind, planned.device.name)
    assert any("a100 on-demand" in line for line in lines), lines
    forty = shardline.plan(shardline.Spec.load("tiny", sets | {"launch.vertex.accelerator": "NVIDIA_TESLA_A100"}))
    assert forty.device.name != planned.device.name and forty.device.memory_bytes < planned.device.memory_bytes
    with pytest.raises(SpecError) as e:
        shardline.plan(shardline.Spec.load("tiny", sets | {"launch.vertex.accelerator": "NVIDIA_TESLA_K80"}))
    assert e.value.field == "launch.vertex.accelerator"
