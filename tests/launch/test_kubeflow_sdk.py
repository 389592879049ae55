"""The Kubeflow SDK path, for real: the SDK's LocalProcessBackend runs a shardline job spec to completion (its
status, logs and wait report it) while rank 0 posts live progress through the SDK's update_trainjob_status to a
stand-in of Trainer's status endpoint; the run directory lands on the spec's storage, not in the directory the SDK
runs the job in, so a replaced pod (the command the SDK's Kubernetes backend gives it, in another directory) resumes
from the checkpoint; the entry point ends the process with the worker's own exit code. The TrainJob the SDK's
Kubernetes backend would create from shardline's runtime is built by the SDK itself and checked against the pinned
CRD (test_kubeflow_runtime.py)."""

from __future__ import annotations

import base64
import inspect
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

import tests.launch.kubeflow_sdk as sdk
from shardline.engines.kubeflow_sdk import shardline_train, trainer_arguments
from shardline.jsonl import read_jsonl
from shardline.rundir import read_manifest
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
            "PIP_NO_COMPILE": "1",  # torch's 20k .pyc files are not under test: ~15 s of the SDK's venv
            "PET_NPROC_PER_NODE": "2", "PET_STANDALONE": "1", **status_env}


@pytest.fixture(scope="module")
def sdk_job(tmp_path_factory):
    """One SDK job of a spec whose run.dir is relative and whose storage (a PVC, here a directory standing for its
    mount) is where the pods of every other Kubernetes target start: the run must land there."""
    from kubeflow.trainer import CustomTrainer, LocalProcessBackendConfig, TrainerClient

    tmp = tmp_path_factory.mktemp("sdk")
    storage = tmp / "storage"
    storage.mkdir()
    spec = load_spec("tiny", [*small_overrides(tmp / "runs"), "run.dir=runs", "parallel.nproc_per_node=2",
                              "observe.report=false", "launch.kubernetes.storage.kind=pvc",
                              "launch.kubernetes.storage.claim=shardline-runs",
                              f"launch.kubernetes.storage.mount_path={storage}"])
    args = trainer_arguments(spec)
    run_id = yaml.safe_load(base64.b64decode(args["func_args"]["spec_b64"]))["run"]["id"]
    with TrainerStatusServer(tmp, "default", "shardline-sdk") as server:
        client = TrainerClient(backend_config=LocalProcessBackendConfig())
        trainer = CustomTrainer(**args, packages_to_install=[f"torch=={torch.__version__}"],
                                env=_job_env(tmp, server.env))
        name = client.train(runtime=client.get_runtime("torch-distributed"), trainer=trainer)
        job = client.wait_for_job_status(name, status={"Complete", "Failed"}, timeout=600, polling_interval=2)
        logs = "\n".join(client.get_job_logs(name))
    return SimpleNamespace(tmp=tmp, args=args, run_dir=storage / "runs" / run_id, client=client, name=name,
                           job=job, logs=logs, server=server)


@pytest.mark.slow
def test_sdk_local_process_backend_runs_a_shardline_spec_to_completion_with_live_progress(sdk_job):
    client, name, logs, server = sdk_job.client, sdk_job.name, sdk_job.logs, sdk_job.server
    assert sdk_job.job.status == "Complete", logs[-4000:]
    assert client.get_job(name).status == "Complete"
    assert "step     6/6" in logs and "Completed with code 0" in logs  # shardline's step line, then the SDK's
    assert server.refused == []
    first, last = server.posts[0]["trainerStatus"], server.posts[-1]["trainerStatus"]
    assert first["progressPercentage"] < 100 and "estimatedRemainingSeconds" in first
    assert last["progressPercentage"] == 100 and last["estimatedRemainingSeconds"] == 0
    metrics = {m["name"]: m["value"] for m in last["metrics"]}
    assert {"loss", "tokens_per_s", "mfu", "goodput", "step", "total_steps"} <= set(metrics)
    assert metrics["step"] == metrics["total_steps"] == "6" and float(metrics["loss"]) > 0
    assert 0 < float(metrics["goodput"]) <= 1


@pytest.mark.slow
def test_sdk_run_lands_on_the_specs_storage_and_a_replaced_pod_resumes_from_its_checkpoint(sdk_job):
    """The SDK runs the job in a temporary directory it deletes afterwards (a pod: the image's WORKDIR, lost with
    the pod); a relative run.dir must still mean the storage. A replaced pod runs the same command, which the SDK's
    Kubernetes backend writes, in a fresh directory: it finds the committed checkpoint and does not start over."""
    from kubeflow.trainer.backends.kubernetes import utils
    from kubeflow.trainer.constants import constants
    from kubeflow.trainer.types import types

    assert sdk_job.job.status == "Complete", sdk_job.logs[-4000:]
    run_dir = sdk_job.run_dir
    assert read_manifest(run_dir).get("status") == "finished", f"no finished run in {run_dir}"
    assert (run_dir / "checkpoints" / "step-00000006" / "COMMITTED").is_file()

    trainer = types.RuntimeTrainer(trainer_type=types.TrainerType.CUSTOM_TRAINER, framework="torch", image="shardline")
    trainer.set_command(constants.TORCH_COMMAND)  # what the SDK gives a runtime with a torch ML policy
    runtime = types.Runtime(name="shardline", trainer=trainer, kind=types.RuntimeKind.CLUSTER_TRAINING_RUNTIME)
    command = utils.get_command_using_train_func(runtime, sdk_job.args["func"], sdk_job.args["func_args"],
                                                 constants.DEFAULT_PIP_INDEX_URLS, None)
    pod_dir = sdk_job.tmp / "replaced-pod"
    pod_dir.mkdir()
    env = {"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
           "HOME": os.environ.get("HOME", "/tmp"), "PYTHONPATH": str(REPO / "src"),
           "PET_NPROC_PER_NODE": "2", "PET_STANDALONE": "1"}
    done = subprocess.run(command, cwd=pod_dir, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert sorted(p.name for p in pod_dir.iterdir()) == ["kubeflow_sdk.py"]  # only the SDK's own file
    records = read_jsonl(run_dir / "metrics.jsonl")
    resumes = [r for r in records if r.get("event") == "resume"]
    assert [r["step"] for r in resumes] == [6], done.stdout[-4000:]
    assert [r["step"] for r in records if r.get("kind") == "train"] == [1, 2, 3, 4, 5, 6]  # none trained again
    assert read_manifest(run_dir)["status"] == "finished"


def test_sdk_entry_point_ends_the_process_with_the_workers_exit_code_without_finalising(tmp_path):
    """The entry point as the SDK runs it (its source and the call with func_args, alone in a file) ends the
    process itself with the worker's code, its output flushed, as `python -m shardline.worker` does: finalising
    the interpreter under gloo's threads can abort a run that finished (shardline.worker.exit_without_teardown)."""
    args, code = trainer_arguments(load_spec("tiny", [f"run.dir={tmp_path / 'runs'}"])), 75  # preempted
    stub = ("import atexit, sys\nimport shardline.worker\n"
            "atexit.register(lambda: print('interpreter finalised'))\n"
            f"shardline.worker.main = lambda argv: sys.stdout.write('worker output, unflushed') and {code}\n")
    script = tmp_path / "train.py"
    script.write_text(f"{stub}\n{inspect.getsource(shardline_train)}\nshardline_train(**{args['func_args']})\n")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert done.returncode == code, done.stderr[-2000:]
    assert "worker output, unflushed" in done.stdout
    assert "interpreter finalised" not in done.stdout


def test_sdk_entry_point_refuses_a_storage_it_cannot_enter(tmp_path, capsys):
    """Without the storage mounted (a runtime other than shardline's), the run would silently go to the pod's own
    disk: bad input instead, naming the field."""
    from shardline.engines.kubeflow_sdk import run_worker

    spec = load_spec("tiny", ["launch.kubernetes.storage.kind=pvc", "launch.kubernetes.storage.claim=runs",
                              f"launch.kubernetes.storage.mount_path={tmp_path / 'not-mounted'}"])
    assert run_worker(trainer_arguments(spec)["func_args"]) == 2
    assert "launch.kubernetes.storage.mount_path" in capsys.readouterr().err
