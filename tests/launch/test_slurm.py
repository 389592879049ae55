"""Slurm backend: the rendered sbatch script, and real jobs on a single-host Slurm with two simulated nodes."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from shardline.engines.backend import load_record, wait_for
from shardline.engines.registry import get_backend
from shardline.engines.slurm import parse_job
from shardline.errors import ShardlineError, SpecError
from shardline.run_status import read_status
from shardline.rundir import create_run, read_spec
from shardline.spec.resolve import load_spec
from tests.conftest import free_port, read_metrics, small_overrides
from tests.launch import slurm_cluster
from tests.launch.slurm_cluster import SlurmCluster


def _render(*extra: str) -> tuple[str, dict]:
    spec = load_spec("tiny", ["run.id=r1", "run.dir=/shared/runs", "launch.nnodes=4", "parallel.nproc_per_node=8",
                              "train.global_batch_size=256", *extra])
    files = get_backend("slurm").render(spec)
    return files["job.sbatch"], yaml.safe_load(files["spec.yaml"])


def test_sbatch_script_asks_for_the_allocation_and_runs_one_torchrun_per_node():
    script, spec = _render("launch.slurm.partition=a3mega", "launch.slurm.account=ml", "launch.slurm.qos=high",
                           "launch.slurm.time_limit=2-00:00:00", "launch.slurm.cpus_per_task=200",
                           "launch.grace_seconds=120", "launch.profile=a3-mega", "launch.slurm.workdir=/shared",
                           "launch.slurm.sbatch_args=[--constraint=h100]",
                           "launch.slurm.setup=[module load cuda/12.8, source /shared/venv/bin/activate]")
    for line in ("--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--cpus-per-task=200",
                 "--time=2-00:00:00", "--partition=a3mega", "--account=ml", "--qos=high", "--exclusive",
                 "--requeue", "--signal=B:USR1@120", "--chdir=/shared", "--output=/shared/runs/r1/logs/slurm-%j.out",
                 "--constraint=h100"):
        assert f"#SBATCH {line}\n" in script
    assert "module load cuda/12.8\nsource /shared/venv/bin/activate\n" in script
    assert "export NCCL_FASTRAK_NUM_FLOWS=2\n" in script and "export PET_MASTER_PORT=29500\n" in script
    assert "trap 'forward USR1' USR1" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--output=/shared/runs/r1/logs/slurm-%j-node%n.out" in srun
    assert "'export PET_NODE_RANK=$SLURM_NODEID; exec python -m shardline.engines.torchrun --nnodes=4 " \
           "--nproc-per-node=8" in srun
    assert "-m shardline.worker --spec /shared/runs/r1/slurm/spec.yaml --task train'" in srun
    assert spec["run"]["id"] == "r1" and spec["launch"]["nnodes"] == 4  # the resolved spec beside the script


def test_cpu_nodes_and_shared_nodes_drop_the_gpu_and_exclusive_requests():
    script, _ = _render("launch.slurm.gpus_per_node=0", "launch.slurm.exclusive=false")
    assert "--gpus-per-node" not in script and "--exclusive" not in script and "--partition" not in script
    assert "--time=24:00:00" in script


def test_rendered_script_is_valid_bash_and_shellcheck_clean(tmp_path):
    script, _ = _render("launch.slurm.setup=[source /venv/bin/activate]", "launch.slurm.secret_env=[HF_TOKEN]")
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    if shutil.which("shellcheck") is None:  # a failure under CI=true (tests/skip_policy.py)
        pytest.skip("Debian package shellcheck (scripts/apt-packages.txt)")
    out = subprocess.run(["shellcheck", "-S", "warning", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_a_run_without_id_gets_one_and_a_bad_time_limit_names_the_field():
    files = get_backend("slurm").render(load_spec("tiny"))
    assert yaml.safe_load(files["spec.yaml"])["run"]["id"].startswith("tiny-")
    with pytest.raises(SpecError, match="launch.slurm.time_limit"):
        load_spec("tiny", ["launch.slurm.time_limit=two days"])


def test_scontrol_job_lines_parse_into_fields():
    job = parse_job("JobId=7 JobName=r1 JobState=PENDING Reason=BeginTime Dependency=(null) Restarts=1 "
                    "NodeList=(null) ExitCode=0:0 Command=/x/job.sbatch")
    assert job["JobState"] == "PENDING" and job["Reason"] == "BeginTime" and job["Restarts"] == "1"


# ---- a real Slurm: munged, slurmctld and two slurmd on this host ------------------------------------------

@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = slurm_cluster.missing()
    if why:
        pytest.skip(why)
    mp = pytest.MonkeyPatch()
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
        mp.setenv("SLURM_CONF", str(cluster.conf))
        yield cluster
    mp.undo()


def _job_spec(session_dir: Path, tmp_path: Path, *extra: str):
    venv = Path(sys.executable).parent
    overrides = [*small_overrides(session_dir / "runs"), f"run.dir={tmp_path / 'runs'}", "launch.nnodes=2",
                 "parallel.nproc_per_node=1", "launch.slurm.gpus_per_node=0", f"launch.slurm.workdir={tmp_path}",
                 f"launch.slurm.setup=[export PATH={venv}:$PATH, export PET_MASTER_PORT={free_port()}, "
                 "export TOKENIZERS_PARALLELISM=false]", "observe.metrics_port=null", *extra]
    return load_spec("tiny", overrides)


def _wait_until(cond, timeout: float, what: str, on_timeout=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"{what}: {on_timeout()}")


def _run_dir(record) -> Path:
    return Path(record.objects[0]["runDir"])


def _all_logs(backend, record) -> str:
    return "\n".join(backend.logs(record, None, follow=False))[-6000:]


@pytest.mark.slow
def test_two_node_job_is_signalled_checkpoints_requeues_resumes_and_finishes(slurm, session_dir, prepared, tmp_path):
    spec = _job_spec(session_dir, tmp_path, "train.max_steps=16", "checkpoint.every_steps=100")
    backend = get_backend("slurm")
    record = backend.submit(spec)
    run = _run_dir(record)
    assert load_record(str(run)).job_id == record.job_id  # launch.json beside the run
    # signal once training is under way on both nodes
    _wait_until(lambda: (run / "metrics.jsonl").is_file() and read_metrics(run, "train"), 240, "no training step",
                lambda: _all_logs(backend, record))
    subprocess.run(["scancel", "--signal=USR1", "--batch", record.job_id], check=True, env=slurm.env)
    # a requeued job is held until its old credential expires (cred_expire: 5 s here, 120 s by default)
    _wait_until(lambda: parse_job(slurm.run("scontrol", "show", "job", "-o", record.job_id)).get("Reason")
                == "BeginTime", 120, "not requeued", lambda: _all_logs(backend, record))
    state = backend.status(record)
    assert state.phase == "queued" and state.restarts == 1 and "begin time" in state.reasons[0], state
    assert wait_for(backend, record, timeout_s=300, poll_s=1) == 0, _all_logs(backend, record)
    events = read_metrics(run, "event")
    preempted = [e for e in events if e["event"] == "preempted"]
    resumed = [e for e in events if e["event"] == "resume"]
    assert preempted and preempted[0]["signal"] == "SIGUSR1", events
    assert resumed and resumed[0]["step"] == preempted[0]["step"] and resumed[0]["world"] == 2
    steps = [r["step"] for r in read_metrics(run, "train")]
    assert max(steps) == 16 and set(steps) == set(range(1, 17))
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "finished" and manifest["world_size"] == 2
    logs = "\n".join(backend.logs(record, None, follow=False))
    assert "[node 0]" in logs and "[node 1]" in logs and "requeueing job" in logs
    assert backend.status(record).phase == "succeeded"
    goodput = read_status(run).goodput  # the requeue is an attempt: its gap and recovery are measured
    assert [a.ended_by for a in goodput.attempts] == ["preempted", "finished"] and goodput.buckets["wasted"] == 0
    assert goodput.buckets["restart_gap"] > 0 and goodput.attempts[1].recovery_s > goodput.buckets["restart_gap"]
    print(f"slurm requeue: recovery {goodput.attempts[1].recovery_s:.1f} s; {goodput.line()}")


@pytest.mark.slow
def test_netcheck_runs_as_a_two_node_slurm_job_and_writes_its_result_to_the_run(slurm, session_dir, tmp_path):
    spec = _job_spec(session_dir, tmp_path, "launch.netcheck.min_bytes=4096", "launch.netcheck.max_bytes=65536",
                     "launch.netcheck.factor=16", "launch.netcheck.iters=3", "launch.netcheck.warmup=1")
    backend = get_backend("slurm")
    record = backend.submit(spec, task="netcheck")
    assert wait_for(backend, record, timeout_s=240, poll_s=1) == 0, _all_logs(backend, record)
    doc = json.loads((_run_dir(record) / "netcheck.json").read_text())
    assert doc["world_size"] == 2 and doc["passed"] and doc["wrong"] == 0 and len(doc["records"]) == 2 * 9
    assert "all_gather · 2 ranks" in "\n".join(backend.logs(record, 0, follow=False))


def test_values_from_the_spec_never_run_as_shell_code(tmp_path):
    """A hostile run.dir reaches sbatch and srun as a literal, checked by running the script with stub commands."""
    marker = tmp_path / "pwned"
    payload = f"x$(touch${{IFS}}{marker})`touch${{IFS}}{marker}`"  # no spaces: those are refused earlier
    spec = load_spec("tiny", ["run.id=r1", f"run.dir={tmp_path}/{payload}"])
    script = get_backend("slurm").render(spec)["job.sbatch"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node0\n")
    (bin_dir / "srun").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/srun-args\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    (tmp_path / "job.sbatch").write_text(script)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "node0"}
    subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, capture_output=True, timeout=60, check=True)
    assert not marker.exists()
    args = (tmp_path / "srun-args").read_text().splitlines()
    assert f"--output={tmp_path}/{payload}/r1/logs/slurm-%j-node%n.out" in args


@pytest.mark.parametrize(("field", "value"), [("run.dir", '"/shared/a\\nrm -rf /"'),
                                              ("launch.slurm.partition", '"a3 --wrap=x"'),
                                              ("launch.slurm.sbatch_args", '["--constraint=h100\\n#SBATCH --x"]'),
                                              ("launch.slurm.setup", '["module load x\\nrm -rf /"]')])
def test_line_breaks_and_split_words_in_slurm_values_are_named_errors(field, value):
    spec = load_spec("tiny", ["run.id=r1", f"{field}={value}"])
    with pytest.raises(SpecError) as e:
        get_backend("slurm").render(spec)
    assert e.value.where.startswith(field)


def _stub_slurm(tmp_path: Path, monkeypatch) -> Path:
    """sbatch runs the script at once with the submitting environment (as --export=ALL does); srun records its
    environment outside the run directory."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/sbatch-args\n'
                                    'for a; do script="$a"; done\n'
                                    'SLURM_JOB_ID=42 SLURM_JOB_NODELIST=node0 \\\n'
                                    f'  bash "$script" > {tmp_path}/batch.out 2>&1\n'
                                    'echo 42\n')
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node0\n")
    (bin_dir / "srun").write_text(f"#!/bin/sh\nenv > {tmp_path}/srun-env\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return bin_dir


def test_secret_env_reaches_the_job_by_name_and_no_file_in_the_run_holds_its_value(tmp_path, monkeypatch):
    token, key = "hf_secret-value-7f3a", "wandb-secret-value-91c2"
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setenv("WANDB_API_KEY", key)
    _stub_slurm(tmp_path, monkeypatch)
    spec = load_spec("tiny", ["run.id=r1", f"run.dir={tmp_path / 'runs'}", f"launch.slurm.workdir={tmp_path}",
                              "launch.slurm.secret_env=[HF_TOKEN, WANDB_API_KEY]"])
    record = get_backend("slurm").submit(spec)
    assert record.job_id == "42"
    assert "--export=ALL" in (tmp_path / "sbatch-args").read_text().splitlines()
    node_env = (tmp_path / "srun-env").read_text().splitlines()
    assert f"HF_TOKEN={token}" in node_env and f"WANDB_API_KEY={key}" in node_env
    run_dir = tmp_path / "runs" / "r1"
    create_run(read_spec(run_dir / "slurm" / "spec.yaml"))  # what the worker writes first: spec.yaml, manifest
    script = (run_dir / "slurm" / "job.sbatch").read_text()
    assert "#SBATCH --export=ALL" in script and "export HF_TOKEN WANDB_API_KEY" in script
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {"job.sbatch", "spec.yaml", "manifest.json"} <= {p.name for p in written}
    for path in written:
        text = path.read_bytes()
        assert token.encode() not in text and key.encode() not in text, path


def test_a_secret_missing_at_submit_or_on_the_node_is_an_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    _stub_slurm(tmp_path, monkeypatch)
    spec = load_spec("tiny", ["run.id=r1", f"run.dir={tmp_path / 'runs'}", "launch.slurm.secret_env=[HF_TOKEN]"])
    with pytest.raises(ShardlineError) as e:
        get_backend("slurm").submit(spec)
    assert e.value.where == "launch.slurm.secret_env" and "HF_TOKEN" in e.value.problem
    assert "export HF_TOKEN" in e.value.fix and not (tmp_path / "runs").exists()
    # a script submitted by hand (`shardline render`, then sbatch) refuses to start the step without it
    (tmp_path / "job.sbatch").write_text(get_backend("slurm").render(spec)["job.sbatch"])
    out = subprocess.run(["bash", str(tmp_path / "job.sbatch")], capture_output=True, text=True, timeout=60,
                         env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "SLURM_JOB_ID": "1",
                              "SLURM_JOB_NODELIST": "node0"})
    assert out.returncode != 0 and "HF_TOKEN" in out.stderr and not (tmp_path / "srun-env").exists()


def test_setup_lines_holding_a_literal_secret_are_refused_and_point_to_secret_env():
    with pytest.raises(SpecError) as e:
        _render("launch.slurm.setup=[module load cuda, export HF_TOKEN=hf_abc123]")
    assert e.value.where == "launch.slurm.setup[1]" and "launch.slurm.secret_env: [HF_TOKEN]" in e.value.fix
    script, _ = _render('launch.slurm.setup=["export TOKENIZERS_PARALLELISM=false", '
                        '"export HF_TOKEN=$(cat ~/.hf-token)", "export HF_TOKEN_PATH=/shared/hf"]')
    assert "export HF_TOKEN=$(cat ~/.hf-token)" in script
    with pytest.raises(SpecError) as e:
        _render("launch.slurm.secret_env=[HF_TOKEN]", "launch.slurm.sbatch_args=[--export=NONE]")
    assert e.value.where == "launch.slurm.sbatch_args[0]"
