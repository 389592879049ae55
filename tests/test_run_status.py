"""What a run directory says is true: a run whose processes are gone is never "running", progress and ETA
come from its own records, and `shardline runs` lists runs newest first."""

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from shardline.run_status import (
    eta_seconds,
    format_duration,
    is_alive,
    list_runs,
    process_entry,
    read_status,
    record_process,
    settle,
)
from shardline.rundir import create_run, read_manifest, update_manifest
from tests.conftest import run_cli, small_spec


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _run(tmp_path, **manifest):
    spec, run_dir = create_run(small_spec(tmp_path))
    update_manifest(run_dir, **manifest)
    return run_dir


def _append(run_dir, *records):
    with (run_dir / "metrics.jsonl").open("a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def _train(step: int, t: float, step_time: float = 2.0, **kw) -> dict:
    return {"kind": "train", "time": t, "step": step, "loss": 1.0 / step, "step_time_s": step_time,
            "tokens_per_s_per_device": 100.0, "mfu": 0.3, **kw}


def test_a_process_is_alive_only_while_it_is_the_same_process():
    me = process_entry(os.getpid(), "test")
    assert is_alive(me) is True
    assert is_alive({**me, "start_ticks": me["start_ticks"] + 1}) is False  # a reused pid is not the run's
    assert is_alive(process_entry(_dead_pid(), "gone")) is False
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    entry = process_entry(zombie.pid, "zombie")
    time.sleep(0.5)  # exited, not yet reaped: a zombie is not running
    assert is_alive(entry) is False
    zombie.wait()
    assert is_alive({**me, "host": socket.gethostname() + "-elsewhere"}) is None


def test_a_running_run_whose_processes_are_gone_is_settled_failed_with_its_last_checkpoint(tmp_path):
    run_dir = _run(tmp_path, status="running")
    record_process(run_dir, _dead_pid(), "launcher")
    record_process(run_dir, _dead_pid(), "torchrun")
    now = time.time()
    _append(run_dir, _train(1, now), {"kind": "event", "event": "checkpoint_committed", "step": 2, "time": now},
            _train(2, now + 1), _train(3, now + 2))
    status = read_status(run_dir)
    assert status.status == "failed"
    assert "its processes are gone (launcher pid" in status.failure["message"]
    assert "the last committed checkpoint is step 2" in status.failure["message"]
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "failed" and manifest["failure"]["committed_step"] == 2
    assert manifest["end_time"] == now + 2  # the last sign of life, not when somebody looked


def test_a_run_with_one_live_process_or_processes_elsewhere_stays_running(tmp_path):
    run_dir = _run(tmp_path, status="running")
    record_process(run_dir, _dead_pid(), "torchrun")
    record_process(run_dir, os.getpid(), "rank 0")
    assert read_status(run_dir).status == "running"
    other = _run(tmp_path, status="running",
                 processes=[{"pid": 1, "role": "rank 0", "host": "node-7", "start_ticks": 1}])
    assert read_status(other).status == "running"  # another host: its engine's status decides, not this one


def test_dead_workers_with_failure_records_are_told_by_their_records(tmp_path):
    from shardline.failures import WorkerFailure, write_failure

    run_dir = _run(tmp_path, status="running")
    record_process(run_dir, _dead_pid(), "launcher")
    write_failure(run_dir, WorkerFailure(rank=1, host="h", error_type="ValueError", message="bad shape",
                                         phase="training", step=4, max_steps=6, committed_step=2, checkpoint=None,
                                         log="logs/rank-1.log", time=time.time()))
    failure = read_status(run_dir).failure
    assert failure["rank"] == 1 and failure["error_type"] == "ValueError" and "bad shape" in failure["message"]


def test_finished_and_preempted_runs_are_never_touched(tmp_path):
    for status in ("finished", "preempted"):
        run_dir = _run(tmp_path, status=status)
        record_process(run_dir, _dead_pid(), "launcher")
        assert settle(run_dir)["status"] == status


def test_eta_elapsed_and_projected_cost_come_from_the_recent_pace(tmp_path):
    run_dir = _run(tmp_path, status="running")
    record_process(run_dir, os.getpid(), "launcher")
    now = time.time()
    _append(run_dir, _train(1, now, step_time=30.0), *(_train(s, now + s, cost_usd=0.01 * s) for s in range(2, 5)))
    status = read_status(run_dir)
    assert status.step == 4 and status.max_steps == 6
    assert status.eta_s == 2 * 2.0  # median of the recent step times (30, 2, 2, 2) × 2 steps left
    assert abs(status.projected_cost_usd - 0.06) < 1e-9
    assert "step 4/6" in status.progress_line() and "ETA 4s" in status.progress_line()
    assert eta_seconds([1.0, 3.0], 0) == 0.0 and eta_seconds([], 3) is None
    assert format_duration(3725) == "1h02m" and format_duration(65) == "1m05s"


def test_runs_lists_every_run_newest_first_as_a_table_and_json(tmp_path):
    older = _run(tmp_path, status="finished", start_time="2026-01-01T00:00:00+00:00")
    newer = _run(tmp_path, status="running", start_time="2026-02-01T00:00:00+00:00")
    record_process(newer, os.getpid(), "launcher")
    _append(newer, _train(3, time.time()), {"kind": "eval", "step": 3, "val_loss": 0.5, "time": time.time()})
    assert [r.run_dir for r in list_runs(tmp_path / "runs")] == [str(newer.resolve()), str(older.resolve())]
    out = run_cli("runs", str(tmp_path / "runs"), "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["status"] for r in rows] == ["running", "finished"]
    assert rows[0]["step"] == 3 and rows[0]["val_loss"] == 0.5 and rows[0]["max_steps"] == 6
    table = run_cli("runs", str(tmp_path / "runs"))
    assert newer.name in table.stdout and "3/6" in table.stdout and "0.5000" in table.stdout
    assert table.stdout.index(newer.name) < table.stdout.index(older.name)


def test_training_a_run_again_while_it_still_runs_is_refused_and_changes_nothing(tmp_path, capsys):
    # was: the manifest reset to `starting`, two trainings sharing checkpoints, `cancel` unable to reach the first
    import os

    from shardline.cli import main
    from shardline.run_status import record_process
    from shardline.rundir import create_run, read_manifest
    from tests.conftest import small_spec

    _, run_dir = create_run(small_spec(tmp_path))
    record_process(run_dir, os.getpid(), "launcher")  # this test process: alive
    before = read_manifest(run_dir)
    assert main(["train", str(run_dir)]) == 2
    out = capsys.readouterr().err  # errors go to stderr
    assert "is still running: launcher" in out and "shardline cancel" in out
    assert read_manifest(run_dir) == before


def test_a_launcher_settling_its_attempt_never_marks_a_newer_attempt(tmp_path):
    # was: the old launcher's verdict (failed, its exit code) written over a relaunch that had reset the manifest
    from shardline.run_status import settle
    from shardline.rundir import create_run, read_manifest, read_spec
    from tests.conftest import small_spec

    _, run_dir = create_run(small_spec(tmp_path))
    create_run(read_spec(run_dir / "spec.yaml"))  # a relaunch: attempt 2, status starting
    assert settle(run_dir, exit_code=1, attempt=1)["status"] == "starting"
    assert read_manifest(run_dir)["status"] == "starting"
    assert settle(run_dir, exit_code=1, attempt=2)["status"] == "failed"  # its own attempt: settled


@pytest.mark.slow
def test_two_trainings_of_one_run_started_at_once_train_it_once(tmp_path):
    """Both pass the live-process check when started within a second (neither has recorded itself yet): the
    launcher's lock on the run directory lets exactly one train; the other is refused, and no step is recorded
    twice."""
    from shardline.rundir import create_run
    from tests.conftest import REPO, read_metrics, small_spec

    _, run_dir = create_run(small_spec(tmp_path, "train.max_steps=3", "train.precision=fp32",
                                       "observe.metrics_port=null", "observe.report=false"))
    cmd = [sys.executable, "-m", "shardline.cli", "train", str(run_dir)]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], results
    refused = next(err for code, _, err in results if code == 2)
    assert "another shardline process" in refused or "is still running" in refused
    assert [r["step"] for r in read_metrics(run_dir, "train")] == [1, 2, 3]


# ---- one outcome word, and runs on other hosts ---------------------------------------------------------------
def _words_in_runs_table(out: str) -> dict[str, str]:
    """Run id → the word in the `status` column of `shardline runs`' table."""
    rows = [[cell.strip() for cell in re.split("[│┃]", line)] for line in out.splitlines()
            if len(re.findall("[│┃]", line)) > 2]
    header, *body = rows
    column = header.index("status")
    return {row[1]: row[column] for row in body}


def _word_of_status(out: str) -> str:
    """The outcome in `shardline status`' first line: `<run id> (<target>): <word>`."""
    return out.splitlines()[0].split("): ", 1)[1].split(" · ")[0].strip()


def test_status_and_runs_name_every_outcome_with_the_same_word(tmp_path, capsys):
    # was: `status` said "succeeded" (the engines' phase) where `runs` said "finished" (the manifest's word)
    from shardline.cli import main
    from shardline.run_status import LIVE, Status

    runs = {}
    for status in Status.__args__:
        run_dir = _run(tmp_path, status=status)
        if status in LIVE:
            record_process(run_dir, os.getpid(), "launcher")
        runs[status] = run_dir
    runs["running elsewhere"] = _elsewhere(tmp_path, silent_s=5)
    assert main(["runs", str(tmp_path / "runs")]) == 0
    listed = _words_in_runs_table(capsys.readouterr().out)
    printed = {}
    for status, run_dir in runs.items():
        assert main(["status", str(run_dir)]) == 0
        printed[status] = _word_of_status(capsys.readouterr().out)
    assert printed == {status: listed[run_dir.name] for status, run_dir in runs.items()}
    assert printed["finished"] == "succeeded"  # the word `wait` and the cluster engines use
    rows = json.loads(run_cli("runs", str(tmp_path / "runs"), "--json").stdout)
    assert {r["run_id"]: r["outcome"] for r in rows} == {d.name: printed[s] for s, d in runs.items()}


HEARTBEAT = ".launcher.heartbeat"


def _elsewhere(tmp_path, silent_s: float):
    """A run launched on node-7 in a run directory this host shares (NFS, a FUSE bucket): its manifest and its
    launcher's heartbeat as that launcher wrote them, the last write `silent_s` ago."""
    run_dir = _run(tmp_path, status="running", host="node-7",
                   processes=[{"pid": 4242, "role": "launcher", "host": "node-7", "start_ticks": 1}])
    then = time.time() - silent_s
    (run_dir / HEARTBEAT).write_text(json.dumps({"host": "node-7", "pid": 4242, "time": then}))
    for name in ("manifest.json", HEARTBEAT):
        os.utime(run_dir / name, (then, then))
    return run_dir


def test_a_run_alive_on_another_host_is_reported_alive_there(tmp_path, capsys):
    from shardline.cli import main

    run_dir = _elsewhere(tmp_path, silent_s=5)
    status = read_status(run_dir)
    assert status.status == "running"
    assert status.liveness == "alive on node-7 (last heartbeat 5s ago)"
    assert main(["status", str(run_dir)]) == 0
    assert "alive on node-7 (last heartbeat 5s ago)" in capsys.readouterr().out


def test_training_a_run_alive_on_another_host_is_refused_and_says_how_to_override(tmp_path, capsys):
    # was: its pid, absent on this host, read as "gone": the run was reset and trained here as well
    from shardline.cli import main

    run_dir = _elsewhere(tmp_path, silent_s=5)
    before = read_manifest(run_dir), (run_dir / HEARTBEAT).read_text()
    assert main(["train", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "is alive on node-7 (last heartbeat 5s ago)" in err
    assert "shardline cancel" in err and "no heartbeat for 2m00s" in err  # the override: a dead host goes silent
    assert (read_manifest(run_dir), (run_dir / HEARTBEAT).read_text()) == before
    from shardline.run_status import refuse_if_running
    from shardline.rundir import RunAliveElsewhere

    with pytest.raises(RunAliveElsewhere):
        refuse_if_running(run_dir)  # `launch --target local` and the Python API ask the same question


def test_a_run_silent_on_another_host_is_presumed_dead_and_may_be_trained_here(tmp_path, capsys):
    from shardline.cli import main
    from shardline.run_status import refuse_if_running
    from shardline.rundir import claim_run

    run_dir = _elsewhere(tmp_path, silent_s=3600)
    assert read_status(run_dir).liveness == "presumed dead on node-7 (no heartbeat for 1h00m)"
    assert main(["status", str(run_dir)]) == 0
    assert "presumed dead on node-7 (no heartbeat for 1h00m)" in capsys.readouterr().out
    refuse_if_running(run_dir)
    claim_run(run_dir)  # this launcher takes the run over, and says so in the heartbeat
    beat = json.loads((run_dir / HEARTBEAT).read_text())
    assert (beat["host"], beat["pid"]) == (socket.gethostname(), os.getpid())


def test_an_attempt_just_created_on_another_host_is_refused_before_its_launcher_beats(tmp_path):
    # this host's heartbeat from an earlier attempt is older than node-7's new manifest: the manifest names the host
    from shardline.run_status import refuse_if_running
    from shardline.rundir import RunAliveElsewhere

    run_dir = _run(tmp_path, status="finished")
    (run_dir / HEARTBEAT).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": 0}))
    os.utime(run_dir / HEARTBEAT, (time.time() - 3600, time.time() - 3600))
    update_manifest(run_dir, status="starting", host="node-7", processes=[])
    assert read_status(run_dir).liveness == "alive on node-7 (last heartbeat 0s ago)"
    with pytest.raises(RunAliveElsewhere):
        refuse_if_running(run_dir)
