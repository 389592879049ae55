"""Kills, signals and world-size changes on real 2-process torchrun runs: nothing lost, nothing repeated."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from shardline.checkpointing.manager import CheckpointStore
from shardline.data.loader import StepSampler
from shardline.errors import EXIT_PREEMPTED
from shardline.goodput import BADPUT, BUCKETS
from shardline.run_status import read_status
from tests.conftest import (
    REPO,
    cli_in_background,
    kill_the_stopped_worker,
    only_run,
    prepared_of_run,
    read_metrics,
    run_cli,
    small_overrides,
)

pytestmark = pytest.mark.slow
STEPS = 32
COMMON = ["train.precision=fp32", f"train.max_steps={STEPS}", "train.lr=1e-2", "checkpoint.every_steps=4",
          "observe.report=true"]  # the goodput checks read the report


def _sets(runs: Path, *extra: str) -> list[str]:
    return [a for o in [*small_overrides(runs), *COMMON, *extra] for a in ("--set", o)]


def _start(runs: Path, *extra: str, nproc: int = 2) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "shardline.cli", "train", *_sets(runs, *extra), "--nproc", str(nproc)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, TOKENIZERS_PARALLELISM="false"), start_new_session=True)


def _wait_for_step(runs: Path, step: int, proc: subprocess.Popen, committed: int | None = None) -> Path:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        runs_found = [p for p in runs.glob("*/metrics.jsonl")]
        if runs_found:
            run = runs_found[0].parent
            done = [r["step"] for r in read_metrics(run, "train")]
            ok = committed is None or (run / "checkpoints" / f"step-{committed:08d}" / "COMMITTED").exists()
            if done and max(done) >= step and ok:
                return run
        time.sleep(0.05)
    raise TimeoutError(f"step {step} not reached")


def _losses(run: Path) -> dict[int, float]:
    """Last loss recorded per step (a restarted run re-records the steps after its checkpoint)."""
    return {r["step"]: r["loss"] for r in read_metrics(run, "train")}


def _check_goodput(run: Path, attempts: int, elapsed: float) -> dict:
    """The goodput `status` reports for a finished run adds up, and each bucket is what the records say: the
    productive time is the step time (less data wait) of the steps that stood, the wasted time is the step time
    of the earlier runs of redone steps, and the wall time is the run's (within the test's own clock)."""
    goodput = read_status(run).goodput
    assert goodput is not None and len(goodput.attempts) == attempts
    assert sum(goodput.buckets[b] for b in BUCKETS) == pytest.approx(goodput.wall_s, rel=0.01)
    # Orderings, not a clock margin (the CLI's start before the run exists takes 10 s or 50 s, as the machine is
    # loaded): the run's wall time lies within the test's own, and holds every step it timed.
    train = read_metrics(run, "train")
    assert sum(r["step_time_s"] for r in train) < goodput.wall_s <= elapsed
    last_of = {r["step"]: i for i, r in enumerate(train)}
    stood = [r for i, r in enumerate(train) if last_of[r["step"]] == i]
    redone = [r for i, r in enumerate(train) if last_of[r["step"]] != i]
    assert goodput.buckets["productive"] == pytest.approx(
        sum(r["step_time_s"] - r["data_wait_s"] for r in stood), abs=0.01)
    assert goodput.buckets["wasted"] == pytest.approx(sum(r["step_time_s"] for r in redone), abs=0.01)
    assert goodput.ratio == pytest.approx(goodput.buckets["productive"] / goodput.wall_s, abs=1e-3)
    assert goodput.buckets["startup"] > 0 and goodput.buckets["checkpoint_save"] > 0
    launcher_prepare = sum(a.get("prepare_s", 0) for a in json.loads((run / "manifest.json").read_text())["attempts"])
    assert goodput.buckets["data_preparation"] >= launcher_prepare > 0  # the launcher's, then each worker group's
    assert goodput.buckets["other"] < 0.2 * goodput.wall_s, goodput.buckets  # the records explain the time
    summary = json.loads((run / "summary.json").read_text())["goodput"]  # written as the last attempt ended
    assert summary["attempts"] == attempts
    assert sum(summary[b] for b in BUCKETS) == pytest.approx(summary["wall_s"], rel=0.01)
    events = [e for e in read_metrics(run, "event") if e["event"] == "goodput"]
    assert {e["attempt"] for e in events} == set(range(1, attempts + 1))  # every attempt reported its own
    page = (run / "report" / "index.html").read_text()
    assert "goodput.png" in page and all(b.replace("_", " ") in page for b in BADPUT)
    return goodput.buckets


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    """The uninterrupted run (its goodput checked); the world-size test continues it afterwards."""
    runs = tmp_path_factory.mktemp("reference")
    started = time.time()
    out = run_cli("train", *_sets(runs), "--nproc", "2")
    assert out.returncode == 0, out.stdout[-3000:]
    buckets = _check_goodput(only_run(runs), 1, time.time() - started)
    assert buckets["wasted"] == buckets["restart_gap"] == buckets["checkpoint_restore"] == 0  # undisturbed
    assert "goodput " in out.stdout
    return only_run(runs)


@pytest.fixture(scope="module")
def reference(reference_run) -> dict[int, float]:
    """The uninterrupted run's loss per step, read before any test continues that run."""
    return _losses(reference_run)


def _trained_rows(run: Path) -> dict[int, list[int]]:
    rows: dict[int, list[int]] = {}
    for trace in sorted((run / "logs").glob("samples-rank-*.jsonl")):
        for line in trace.read_text().splitlines():
            rec = json.loads(line)
            rows.setdefault(rec["step"], []).extend(rec["rows"])
    return rows


def test_world_size_change_on_resume_skips_and_repeats_no_sample(reference_run, reference):
    """World 2 → 1 → 2 in one run: steps 1-32 on two ranks (the reference run, its losses read first), 33-35 on
    one, 36-38 on two again."""
    run = reference_run
    for nproc, max_steps in ((1, STEPS + 3), (2, STEPS + 6)):
        again = run_cli("train", str(run), "--nproc", str(nproc), "--set", f"train.max_steps={max_steps}",
                        "--set", "checkpoint.allow_spec_change=true", "--set", "observe.report=false")
        assert again.returncode == 0, again.stdout[-3000:]
    worlds = [e["world"] for e in read_metrics(run, "event") if e["event"] == "setup"]
    assert worlds == [2, 1, 2]
    rows = _trained_rows(run)
    assert sorted(rows) == list(range(1, STEPS + 7))
    n_rows = prepared_of_run(run).stats["splits"]["train"]["rows"]
    sampler = StepSampler(n_rows, 0, global_rows=8, micro_rows=4, world=1)
    for step, got in rows.items():
        expected = np.concatenate([sampler.micro_indices(step - 1, k, 0) for k in range(sampler.accum)])
        assert sorted(got) == sorted(expected.tolist()), step


def test_ctrl_c_and_sigterm_checkpoint_the_step_they_stop_at_and_a_kill_9_restart_finishes_the_run_exactly(
        tmp_path, reference):
    """Ctrl-C signals the whole process group (launcher, torchrun, workers): was a SignalException traceback from
    torchrun and a KeyboardInterrupt traceback per worker and from the launcher, exit 1, the run marked failed. Its
    resume then gets SIGTERM (the launcher only, as `shardline cancel` and schedulers send it). No periodic
    checkpoint in between: each stop commits the step it stopped at. The third attempt saves every 4 steps
    asynchronously (the GPU default path) and restarts once: kill -9 of one worker, then torchrun's restart finishes
    the run."""
    runs = tmp_path / "runs"
    started = time.time()
    proc = _start(runs, "checkpoint.every_steps=100", "launch.grace_seconds=60")
    try:
        run = _wait_for_step(runs, 5, proc)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_PREEMPTED, out[-3000:]
    assert "Traceback" not in out and "SignalException" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    first = [e for e in read_metrics(run, "event") if e["event"] == "preempted"][0]
    assert 5 <= first["step"] < STEPS and first["signal"] == "SIGINT", first
    assert (run / "checkpoints" / f"step-{first['step']:08d}" / "COMMITTED").exists()
    [stopped] = [line for line in out.splitlines() if line.startswith("stopped: ")]
    assert f"resume with `shardline train {run}`" in stopped
    assert f"checkpoint of step {first['step']} is committed" in stopped
    assert json.loads((run / "manifest.json").read_text())["status"] == "preempted"

    proc = subprocess.Popen([sys.executable, "-m", "shardline.cli", "train", str(run)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, TOKENIZERS_PARALLELISM="false"), start_new_session=True)
    try:
        _wait_for_step(runs, first["step"] + 2, proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_PREEMPTED, out[-3000:]
    second = [e for e in read_metrics(run, "event") if e["event"] == "preempted"][1]
    assert first["step"] + 2 <= second["step"] < STEPS - 8 and second["signal"] == "SIGTERM", second
    assert second["grace_used_s"] < 60 and (run / "checkpoints" / f"step-{second['step']:08d}" / "COMMITTED").exists()

    # rank 1 of the third attempt stops itself two steps after its first periodic checkpoint; the test kills it
    killed_at = (second["step"] // 4 + 1) * 4 + 2
    sets = ["launch.max_restarts=1", "checkpoint.async_save=true", "checkpoint.every_steps=4"]
    with cli_in_background("train", str(run), *[a for o in sets for a in ("--set", o)],
                           fault=f"train_step:rank=1:step={killed_at}:action=stop:restart=0") as proc:
        kill_the_stopped_worker(runs, proc)
        out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-6000:]
    resumes = [e for e in read_metrics(run, "event") if e["event"] == "resume"]
    assert [e["step"] for e in resumes[:2]] == [first["step"], second["step"]] and len(resumes) == 3
    assert all(e["rng_restored"] for e in resumes)
    after_kill = resumes[2]["step"]  # the last commit before the kill: the stop's, or the periodic one after it
    assert after_kill in (second["step"], killed_at - 2), resumes
    # every step once, but those the killed attempt trained after its last commit: from each stop step on, no step
    # was trained twice
    steps = Counter(r["step"] for r in read_metrics(run, "train"))
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert sorted(s for s, n in steps.items() if n > 1) == list(range(after_kill + 1, killed_at)), steps
    assert max(steps.values()) == 2
    buckets = _check_goodput(run, 4, time.time() - started)
    assert buckets["wasted"] > 0 and buckets["restart_gap"] > 0 and buckets["checkpoint_restore"] > 0
    goodput = read_status(run).goodput
    assert [a.ended_by for a in goodput.attempts] == ["preempted", "preempted", "failed", "finished"]
    print(f"local torchrun kill -9: recovery {goodput.attempts[3].recovery_s:.1f} s")
    for r in read_metrics(run, "train"):  # every attempt's every step, the redone ones twice
        assert r["loss"] == pytest.approx(reference[r["step"]], rel=1e-6, abs=1e-7), r["step"]


def _wait_for_log(run_dir: Callable[[], Path | None], text: str, proc: subprocess.Popen, ranks: int = 2) -> Path:
    """Wait until every rank's log holds `text` (a fault drill's "fault injected" line: the rank is there now)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        run = run_dir()
        logs = [run / "logs" / f"rank-{r}.log" for r in range(ranks)] if run is not None else []
        if logs and all(log.is_file() and text in log.read_text() for log in logs):
            return run
        time.sleep(0.05)
    raise TimeoutError(f"no rank logged {text!r}")


def _stopped_cleanly(proc: subprocess.Popen, run: Path, out: str, phase: str, signal_name: str) -> None:
    """Exit 75 with a `preempted` manifest, the workers ended on their own (torchrun never SIGKILLed one), and the
    last step's checkpoint is committed and intact."""
    assert proc.returncode == EXIT_PREEMPTED, out[-4000:]
    assert "forcefully exiting via" not in out, out[-4000:]  # torchrun's words when the grace ran out: SIGKILL
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "preempted" and manifest["exit_code"] == EXIT_PREEMPTED, manifest
    preempted = [e for e in read_metrics(run, "event") if e["event"] == "preempted"][-1]
    assert preempted["step"] == 6 and preempted["phase"] == phase and preempted["signal"] == signal_name
    assert preempted["grace_used_s"] < 10
    assert (run / "checkpoints" / "step-00000006" / "COMMITTED").exists()
    assert CheckpointStore(str(run / "checkpoints")).verify(6, 0, 1) == []
    [stopped] = [line for line in out.splitlines() if line.startswith("stopped: ")]
    assert "its checkpoint of step 6 is committed" in stopped and f"shardline train {run}" in stopped


def test_a_stop_in_the_final_validation_or_sql_evaluation_exits_75_with_the_step_committed_and_the_rerun_evaluates(
        tmp_path):
    # Ctrl-C in the final validation, SIGTERM in the SQL evaluation. Was: neither looked at the stop flag, so torchrun
    # SIGKILLed the workers when the grace ran out; the command exited 130 and the manifest said `failed` (the final
    # step was never saved).
    runs = tmp_path / "runs"
    # every validation batch of the last step takes 1.5 s (about 10 of them per rank): far longer than the grace
    sets = _sets(runs, "train.max_steps=6", "data.validation_size=80", "train.eval_examples=4",
                 "launch.grace_seconds=8", "observe.report=false", "observe.metrics_port=null")
    cmd = [sys.executable, "-m", "shardline.cli", "train", *sets, "--nproc", "2"]

    def launched() -> Path | None:
        found = list(runs.glob("*/spec.yaml")) if runs.is_dir() else []
        return found[0].parent if found else None

    env = dict(os.environ, TOKENIZERS_PARALLELISM="false",
               SHARDLINE_FAULT="validation_batch:step=6:action=slow:seconds=1.5")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        run = _wait_for_log(launched, "fault injected: slow at validation_batch (rank", proc)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole process group
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _stopped_cleanly(proc, run, out, "validation", "SIGINT")
    assert not [r for r in read_metrics(run, "eval") if "val_loss" in r]  # the abandoned validation left no score

    # The rerun has nothing to train: it validates, then is stopped (SIGTERM) in the SQL evaluation.
    env["SHARDLINE_FAULT"] = "generation_batch:step=6:action=slow:seconds=2"
    proc = subprocess.Popen([sys.executable, "-m", "shardline.cli", "train", str(run)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_for_log(launched, "fault injected: slow at generation_batch (rank", proc)
        proc.send_signal(signal.SIGTERM)  # to the launcher, as `shardline cancel` and schedulers send it
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _stopped_cleanly(proc, run, out, "sql_evaluation", "SIGTERM")
    assert not (run / "eval.json").exists()
    assert len([e for e in read_metrics(run, "event") if e["event"] == "checkpoint_committed"]) == 2  # steps 4, 6

    again = run_cli("train", str(run), timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert json.loads((run / "manifest.json").read_text())["status"] == "finished"
    assert sorted(r["step"] for r in read_metrics(run, "train")) == [1, 2, 3, 4, 5, 6]  # no step trained twice
    assert [r["step"] for r in read_metrics(run, "eval") if "val_loss" in r] == [6, 6]  # the reruns' validations
    assert json.loads((run / "eval.json").read_text())["n"] >= 1
