"""A failed worker is told once: which rank, in what, the exception, where the traceback is, what is safe."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from rich.console import Console

from shardline.data.prepare import prepare
from shardline.failures import WorkerFailure, failure_message, read_failures, write_failure
from shardline.rundir import create_run, read_manifest, update_manifest
from shardline.training.trainer import Trainer
from tests.conftest import REPO, only_run, small_overrides, small_spec


def _train(tmp_path, fault: str, *extra: str) -> tuple[subprocess.CompletedProcess, object]:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", SHARDLINE_FAULT=fault)
    args = [*small_overrides(tmp_path / "runs"), "parallel.nproc_per_node=2", "observe.metrics_port=null",
            "observe.report=false", "launch.grace_seconds=5", *extra]
    cmd = [sys.executable, "-m", "shardline.cli", "train", "tiny", *[a for kv in args for a in ("--set", kv)]]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    return proc, only_run(tmp_path / "runs")


def _no_torchrun_dump(proc: subprocess.CompletedProcess) -> None:
    both = proc.stdout + proc.stderr
    assert "ChildFailedError" not in both and "Traceback" not in both, both[-3000:]
    assert proc.stderr.count("error:") == 1, proc.stderr


@pytest.mark.slow
def test_evaluation_failure_after_training_says_training_finished_and_the_checkpoint_is_safe(tmp_path):
    proc, run_dir = _train(tmp_path, "sql_evaluation:rank=1", "train.eval_examples=4", "observe.report=true")
    assert proc.returncode == 1
    _no_torchrun_dump(proc)
    message = proc.stderr[proc.stderr.index("error:"):]
    assert "training finished (step 6 of 6), then rank 1 failed while running the final SQL evaluation" in message
    assert "InjectedFault: injected fault at sql_evaluation (rank 1, step 6)" in message
    assert "rank 0 then stopped" in message  # its collective lost the peer: a consequence, not a second cause
    assert "the last checkpoint is safe: step 6" in message
    log = run_dir / "logs" / "rank-1.log"
    assert f"traceback: {log}" in message and "Traceback" in log.read_text()
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "failed" and manifest["exit_code"] == 1
    assert manifest["failure"]["rank"] == 1 and manifest["failure"]["phase"] == "sql_evaluation"
    _the_report_tells_the_failure(run_dir, manifest)


def _the_report_tells_the_failure(run_dir, manifest) -> None:
    """Written once, after the failure was recorded: title, failure box, evaluation "failed", no cost panel."""
    page = run_dir / "report" / "index.html"
    html = page.read_text()
    assert "<span class='bad'>failed</span>" in html and "<span class='bad'>running</span>" not in html
    top = html[:html.index("<h2>Summary</h2>")]
    assert "<h2>Failure</h2>" in top and "InjectedFault" in top and str(run_dir / "logs" / "rank-1.log") in top
    assert "failed: training finished (step 6 of 6), then rank 1 failed" in html
    assert "no SQL evaluation in this run" not in html and "not requested" not in html
    assert not (run_dir / "report" / "cost.png").exists() and "cost.png" not in html  # unpriced: no empty panel
    assert page.stat().st_mtime >= (run_dir / "manifest.json").stat().st_mtime
    chromium = shutil.which("chromium")
    assert chromium, "chromium is installed by scripts/setup (scripts/apt-packages.txt)"
    shot = run_dir / "report" / "screenshot.png"
    out = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          f"--user-data-dir={run_dir / 'chromium-profile'}", "--window-size=1200,900",
                          f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and shot.is_file(), out.stderr[-2000:]
    from PIL import Image

    with Image.open(shot) as im:
        top_third = im.convert("RGB").crop((0, 0, 1200, 300))
        red = sum(n for n, (r, g, b) in top_third.getcolors(1 << 24) if r > 150 and g < 40 and b < 40)
        assert red > 300  # the failure box's border and the red status, drawn above the fold


@pytest.mark.slow
def test_failure_mid_training_names_the_step_and_the_last_committed_checkpoint(tmp_path):
    proc, run_dir = _train(tmp_path, "train_step:rank=0:step=3", "checkpoint.every_steps=2")
    assert proc.returncode == 1
    _no_torchrun_dump(proc)
    assert "rank 0 failed while training in step 3 of 6: InjectedFault" in proc.stderr
    assert "the last checkpoint is safe: step 2" in proc.stderr


@pytest.mark.slow
def test_bad_input_found_by_the_workers_exits_2_with_one_message(tmp_path):
    # A run with no committed checkpoint, made here as `shardline train` makes it before its workers start: a
    # training launch that fails before its first save adds nothing the eval reads (a failure in training is
    # test_failure_mid_training_names_the_step_and_the_last_committed_checkpoint's).
    _, run_dir = create_run(small_spec(tmp_path, "parallel.nproc_per_node=2", "observe.metrics_port=null"))
    eval_proc = subprocess.run([sys.executable, "-m", "shardline.cli", "eval", str(run_dir)], cwd=REPO,
                               capture_output=True, text=True, timeout=600,
                               env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    assert eval_proc.returncode == 2, eval_proc.stderr[-2000:]
    _no_torchrun_dump(eval_proc)
    assert "has no intact committed checkpoint — train the run first" in eval_proc.stderr
    assert "no checkpoint was committed in this run yet" in eval_proc.stderr


def _failure(rank: int, message: str, **kw) -> WorkerFailure:
    fields = dict(rank=rank, host="h", error_type="RuntimeError", message=message, phase="training", step=4,
                  max_steps=10, committed_step=None, checkpoint=None, log=f"logs/rank-{rank}.log", time=100.0)
    return WorkerFailure(**(fields | kw))


def test_ranks_with_the_same_error_are_one_line_and_peer_loss_is_not_a_cause():
    failures = [_failure(1, "Connection closed by peer [127.0.0.1]:5007", time=101.0), _failure(0, "boom"),
                _failure(2, "boom")]
    text = failure_message(failures, {})
    assert text.splitlines()[0] == "ranks 0, 2 failed while training in step 5 of 10: RuntimeError: boom"
    assert "rank 1 then stopped: a collective lost its peer" in text


def test_ranks_that_died_without_a_record_are_named_with_their_signal():
    text = failure_message([], {3: -signal.SIGKILL, 1: 139})
    assert "rank 1 exited with code 139 without a failure record" in text
    assert "rank 3 was killed by SIGKILL (the kernel's OOM killer" in text


def test_records_of_an_earlier_attempt_are_not_read(tmp_path):
    write_failure(tmp_path, _failure(0, "old", time=50.0))
    write_failure(tmp_path, _failure(1, "new", time=150.0))
    assert [f.message for f in read_failures(tmp_path, since=100.0)] == ["new"]
    assert json.loads((tmp_path / "logs" / "failure-rank-1.json").read_text())["message"] == "new"


def test_a_failure_in_the_last_validation_says_training_finished():
    text = failure_message([_failure(0, "boom", phase="validation", step=10)], {})
    assert text.startswith("training finished (step 10 of 10), then rank 0 failed while validating: RuntimeError")
    assert "rank 2 was killed by signal 99" in failure_message([], {2: -99})


def test_the_exit_code_is_the_causing_ranks_even_when_a_peer_aborted_first():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from shardline.engines.torchrun import exit_code

    cause, aborted = ProcessFailure(0, 100, 1, "/nonexistent"), ProcessFailure(1, 101, -6, "/nonexistent")
    cause.timestamp, aborted.timestamp = 20, 10  # the peer that lost its collective died first (SIGABRT)
    error = ChildFailedError("worker", {0: cause, 1: aborted})
    assert exit_code(error) == 128 + 6  # without records: the first to die, as a shell reports a signal
    records = [_failure(0, "InjectedFault: injected fault at train_step"),
               _failure(1, "Connection closed by peer [127.0.0.1]:1234")]
    assert exit_code(error, records) == 1  # before: 134, and Kubernetes/Slurm saw a crash instead of the error


def test_the_exit_code_is_the_causes_own_even_when_torchrun_sigtermed_it_before_it_exited():
    # flaky under load: rank 1 found bad input (exit 2), rank 0 died of the lost peer first, and torchrun's
    # SIGTERM reached rank 1 before its own exit: the run read 143, which engines retry; 2 means "do not retry"
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from shardline.engines.torchrun import exit_code

    lost, cause = ProcessFailure(0, 100, 1, "/nonexistent"), ProcessFailure(1, 101, -15, "/nonexistent")
    lost.timestamp, cause.timestamp = 10, 20
    error = ChildFailedError("worker", {0: lost, 1: cause})
    records = [_failure(1, "data.path: no such file — fix it", error_type="SpecError", exit_code=2, time=99.0),
               _failure(0, "Connection closed by peer [127.0.0.1]:1234")]
    assert exit_code(error, records) == 2


@pytest.mark.slow
def test_a_failed_eval_of_a_finished_run_never_changes_the_training_runs_status(ctx, tmp_path):
    # The finished run is trained in this process and marked finished as the worker marks it after `fit`; the
    # evaluation is the launch under test.
    spec, run_dir = create_run(small_spec(tmp_path, "observe.metrics_port=null"))
    Trainer(spec, ctx, prepare(spec), run_dir, Console(quiet=True)).fit()
    update_manifest(run_dir, status="finished", exit_code=0, end_time=time.time())
    before = read_manifest(run_dir)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", SHARDLINE_FAULT="validation:rank=0")
    ev = subprocess.run([sys.executable, "-m", "shardline.cli", "eval", str(run_dir)], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)
    assert ev.returncode == 1 and "injected fault at validation" in ev.stderr, ev.stderr[-3000:]
    after = read_manifest(run_dir)  # was: status failed, end_time moved to the eval's failure
    assert (after["status"], after["exit_code"], after["end_time"]) == ("finished", 0, before["end_time"])
    assert after.get("failure") is None
