"""The Kubeflow SDK path, for real: the SDK's LocalProcessBackend runs a shardline job spec to completion (its
status, logs and wait report it) while rank 0 posts live progress through the SDK's update_trainjob_status to a
stand-in of Trainer's status endpoint; the TrainJob the SDK's Kubernetes backend would create from shardline's
runtime is built by the SDK itself and checked against the pinned CRD."""

from __future__ import annotations

import base64
import os
import sysconfig
from pathlib import Path

import pytest
import torch
import yaml

import tests.launch.kubeflow_sdk as sdk
from shardline.engines.kubeflow_sdk import trainer_arguments
from shardline.rundir import read_manifest, run_path
from shardline.spec.resolve import load_spec
from tests.conftest import small_overrides
from tests.launch.trainer_status_server import TrainerStatusServer

REPO = Path(__file__).resolve().parents[2]


def _packages_without_pip(tmp: Path) -> Path:
    """.venv's packages as links, less pip and setuptools: the SDK's fresh venv must install its own pip
    (ensurepip skips that when it sees one) so that its `pip install` goes into that venv and nowhere else."""
    view = tmp / "site-packages"
    view.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("pip", "setuptools", "_distutils_hack", "distutils-")):
            (view / entry.name).symlink_to(entry)
    return view


def _job_env(tmp: Path, status_env: dict[str, str]) -> dict[str, str]:
    """The SDK runs the job with exactly this environment. Its venv gets torch installed for its torchrun
    (no dependencies: the wheel the machine's pip configuration picks, as for .venv); shardline, the SDK and every
    other package come from this checkout and .venv. torchrun reads PET_* as it does in a Trainer pod."""
    pip_config = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
    path = os.pathsep.join([str(REPO / "src"), str(sdk.SDK_DIR), str(_packages_without_pip(tmp))])
    return {**pip_config, "PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "PYTHONPATH": path,
            "PIP_NO_DEPS": "1", "PIP_IGNORE_INSTALLED": "1", "PIP_REQUIRE_VIRTUALENV": "1",
            "PET_NPROC_PER_NODE": "2", "PET_STANDALONE": "1", **status_env}


@pytest.mark.slow
def test_sdk_local_process_backend_runs_a_shardline_spec_to_completion_with_live_progress(tmp_path):
    from kubeflow.trainer import CustomTrainer, LocalProcessBackendConfig, TrainerClient

    spec = load_spec("tiny", [*small_overrides(tmp_path / "runs"), "parallel.nproc_per_node=2",
                              "observe.report=false"])
    args = trainer_arguments(spec)
    with TrainerStatusServer(tmp_path, "default", "shardline-sdk") as server:
        client = TrainerClient(backend_config=LocalProcessBackendConfig())
        trainer = CustomTrainer(**args, packages_to_install=[f"torch=={torch.__version__}"],
                                env=_job_env(tmp_path, server.env))
        name = client.train(runtime=client.get_runtime("torch-distributed"), trainer=trainer)
        job = client.wait_for_job_status(name, status={"Complete", "Failed"}, timeout=600, polling_interval=2)
        logs = "\n".join(client.get_job_logs(name))
    assert job.status == "Complete", logs[-4000:]
    assert client.get_job(name).status == "Complete"
    assert "step     6/6" in logs and "Completed with code 0" in logs  # shardline's step line, then the SDK's
    spec.run.id = yaml.safe_load(base64.b64decode(args["func_args"]["spec_b64"]))["run"]["id"]
    assert read_manifest(run_path(spec))["status"] == "finished"
    assert server.refused == []
    first, last = server.posts[0]["trainerStatus"], server.posts[-1]["trainerStatus"]
    assert first["progressPercentage"] < 100 and "estimatedRemainingSeconds" in first
    assert last["progressPercentage"] == 100 and last["estimatedRemainingSeconds"] == 0
    metrics = {m["name"]: m["value"] for m in last["metrics"]}
    assert {"loss", "tokens_per_s", "mfu", "goodput", "step", "total_steps"} <= set(metrics)
    assert metrics["step"] == metrics["total_steps"] == "6" and float(metrics["loss"]) > 0
    assert 0 < float(metrics["goodput"]) <= 1
