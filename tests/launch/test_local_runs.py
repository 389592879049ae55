"""Local runs are first-class: `launch --target local`, `status`, `logs`, `wait`, `cancel` and `runs` on real
2-process runs, and every way a run ends leaves the manifest with its true status."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardline.errors import EXIT_BAD_INPUT, EXIT_PREEMPTED
from shardline.rundir import read_manifest
from tests.conftest import REPO, only_run, read_metrics, run_cli, small_overrides

pytestmark = pytest.mark.slow


def _sets(runs: Path, *extra: str) -> list[str]:
    overrides = [*small_overrides(runs), "parallel.nproc_per_node=2", "observe.metrics_port=null",
                 "launch.grace_seconds=30", *extra]
    return [a for kv in overrides for a in ("--set", kv)]


def _wait_until(predicate, what: str, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise TimeoutError(what)


def _committed_and_step(run_dir: Path, step: int) -> bool:
    if not (run_dir / "metrics.jsonl").is_file():
        return False
    committed = [e for e in read_metrics(run_dir, "event") if e.get("event") == "checkpoint_committed"]
    return bool(committed) and max((r["step"] for r in read_metrics(run_dir, "train")), default=0) >= step


def test_a_detached_local_run_answers_status_logs_cancel_wait_and_runs(tmp_path):
    runs = tmp_path / "runs"
    out = run_cli("launch", "tiny", "--target", "local",
                  *_sets(runs, "train.max_steps=400", "checkpoint.every_steps=2", "observe.report=true"))
    assert out.returncode == 0, out.stderr
    run_dir = only_run(runs)
    assert f"launched {run_dir.name} on local" in out.stdout
    _wait_until(lambda: _committed_and_step(run_dir, 3), "step 3 with a committed checkpoint")

    status = run_cli("status", str(run_dir))
    assert status.returncode == 0, status.stderr
    assert "running" in status.stdout and "/400" in status.stdout and "ETA" in status.stdout, status.stdout
    assert "elapsed" in status.stdout
    by_id = run_cli("status", run_dir.name, "--runs-dir", str(runs))  # a run id under --runs-dir finds it too
    assert "running" in by_id.stdout, by_id.stdout + by_id.stderr

    logs = run_cli("logs", str(run_dir), "--rank", "0")
    assert logs.returncode == 0, logs.stderr
    lines = logs.stdout.splitlines()
    assert lines and all("[rank 0]" in line for line in lines), lines[:5]
    assert any("step " in line and "/400" in line and "ETA" in line for line in lines), lines[-5:]

    cancel = run_cli("cancel", str(run_dir))
    assert cancel.returncode == 0, cancel.stderr
    wait = run_cli("wait", str(run_dir), "--timeout", "240", "--poll", "0.5")
    assert wait.returncode == EXIT_PREEMPTED, wait.stdout + wait.stderr
    assert "preempted" in wait.stdout

    manifest = read_manifest(run_dir)
    assert manifest["status"] == "preempted" and manifest["exit_code"] == EXIT_PREEMPTED
    final = json.loads(run_cli("runs", str(runs), "--json").stdout)
    assert len(final) == 1 and final[0]["status"] == "preempted" and final[0]["target"] == "local"
    assert final[0]["committed_step"] >= 2 and final[0]["eta_s"] is None
    followed = run_cli("logs", str(run_dir), "--follow", timeout=60)  # the run has ended: follow returns
    assert followed.returncode == 0 and "[launcher]" in followed.stdout and "[rank 1]" in followed.stdout
    again = run_cli("cancel", str(run_dir))
    assert again.returncode == EXIT_BAD_INPUT and "is not running (status preempted)" in again.stdout + again.stderr


def test_kill_9_of_the_whole_run_is_found_dead_by_the_next_command(tmp_path):
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "shardline.cli", "train", "tiny",
           *_sets(runs, "train.max_steps=100", "checkpoint.every_steps=2", "observe.report=false")]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    run_dir = _wait_until(lambda: next(iter(runs.glob("*/metrics.jsonl")), None), "a run directory").parent
    _wait_until(lambda: _committed_and_step(run_dir, 3), "step 3 with a committed checkpoint")
    processes = read_manifest(run_dir)["processes"]
    assert {"launcher", "torchrun", "rank 0", "rank 1"} <= {p["role"] for p in processes}
    for p in processes:  # the whole run at once, as the OOM killer or a node reboot would: nobody left to write
        os.kill(p["pid"], signal.SIGKILL)
    proc.wait()
    _wait_until(lambda: subprocess.run(["pgrep", "-f", "--", f"--spec {run_dir}/spec.yaml"],
                                       capture_output=True).returncode != 0, "the workers gone")
    assert read_manifest(run_dir)["status"] == "running"  # what the files say until somebody looks

    status = run_cli("status", str(run_dir))
    assert "failed" in status.stdout and "its processes are gone" in status.stdout, status.stdout
    manifest = read_manifest(run_dir)
    committed = max(e["step"] for e in read_metrics(run_dir, "event") if e.get("event") == "checkpoint_committed")
    assert manifest["status"] == "failed" and manifest["failure"]["committed_step"] == committed
    assert f"the last committed checkpoint is step {committed}" in manifest["failure"]["message"]
    assert run_cli("wait", str(run_dir), "--timeout", "5").returncode == 1

    report = run_cli("report", str(run_dir))
    assert report.returncode == 0, report.stderr
    page = (run_dir / "report" / "index.html").read_text()
    assert "<h2>Failure</h2>" in page and "its processes are gone" in page
    assert "not known (no worker recorded the failure)" in page and f"step {committed}" in page
    assert "not run: the run failed before its final evaluation" not in page  # eval_examples = 0: not requested
    assert "not requested (train.eval_examples = 0)" in page


def test_bad_data_found_after_the_run_was_created_marks_it_failed_with_the_file(tmp_path):
    # the preflight reads the first rows before a run exists: a bad row among them leaves no run behind ...
    early = tmp_path / "early.jsonl"
    early.write_text('{"question": "q", "answer": "a"}\nnot json\n')
    runs = tmp_path / "runs"
    out = run_cli("train", "tiny", *_sets(runs, f"data.path={early}", "observe.report=false"))
    assert out.returncode == EXIT_BAD_INPUT and f"{early}:2" in out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
    assert not runs.exists() or not any(runs.iterdir())
    # ... one further down is found while preparing, after the run was created: the run is failed with the file
    from shardline.data.preflight import PREFLIGHT_ROWS

    bad = tmp_path / "bad.jsonl"
    rows = "".join(f'{{"question": "q{i}", "answer": "a{i}"}}\n' for i in range(PREFLIGHT_ROWS + 50))
    bad.write_text(rows + "not json\n")
    out = run_cli("train", "tiny", *_sets(runs, f"data.path={bad}", "observe.report=false"))
    assert out.returncode == EXIT_BAD_INPUT, out.stdout[-2000:] + out.stderr[-2000:]
    run_dir = only_run(runs)
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "failed" and manifest["exit_code"] == EXIT_BAD_INPUT
    assert str(bad) in manifest["failure"]["message"] and manifest["failure"]["phase"] == "setup"
    status = run_cli("status", str(run_dir))
    assert "failed" in status.stdout and str(bad) in status.stdout
