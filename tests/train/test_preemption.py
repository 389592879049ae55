"""Kills, signals and world-size changes on real 2-process torchrun runs: nothing lost, nothing repeated."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from shardline.data.loader import StepSampler
from shardline.errors import EXIT_PREEMPTED
from tests.conftest import REPO, only_run, read_metrics, run_cli, small_overrides

pytestmark = pytest.mark.slow
STEPS = 24
COMMON = ["train.precision=fp32", f"train.max_steps={STEPS}", "train.lr=1e-2", "checkpoint.every_steps=4"]


def _sets(runs: Path, *extra: str) -> list[str]:
    return [a for o in [*small_overrides(runs), *COMMON, *extra] for a in ("--set", o)]


def _start(runs: Path, *extra: str, nproc: int = 2) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "shardline.cli", "train", *_sets(runs, *extra), "--nproc", str(nproc)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))


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


def _workers(run: Path) -> list[int]:
    out = subprocess.run(["pgrep", "-f", "--", f"-u -m shardline.worker --spec {run}/spec.yaml"], capture_output=True,
                         text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    runs = tmp_path_factory.mktemp("reference")
    out = run_cli("train", *_sets(runs), "--nproc", "2")
    assert out.returncode == 0, out.stdout[-3000:]
    return _losses(only_run(runs))


def test_kill_9_of_one_worker_restarts_and_matches_the_uninterrupted_run(tmp_path, reference):
    runs = tmp_path / "runs"
    proc = _start(runs, "launch.max_restarts=1", "checkpoint.async_save=true")  # the GPU default path
    run = _wait_for_step(runs, 9, proc, committed=8)
    victim = _workers(run)[-1]
    os.kill(victim, signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-6000:]
    resumes = [e for e in read_metrics(run, "event") if e["event"] == "resume"]
    assert resumes and resumes[0]["step"] >= 8 and resumes[0]["rng_restored"]
    losses = _losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-6, abs=1e-7), step


def test_sigterm_checkpoints_at_the_next_step_exits_75_and_the_rerun_matches(tmp_path, reference):
    runs = tmp_path / "runs"
    proc = _start(runs, "checkpoint.every_steps=100", "launch.grace_seconds=60")
    run = _wait_for_step(runs, 6, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, out[-3000:]
    preempted = [e for e in read_metrics(run, "event") if e["event"] == "preempted"][0]
    step = preempted["step"]
    assert 6 <= step < STEPS and preempted["signal"] == "SIGTERM" and preempted["grace_used_s"] < 60
    assert (run / "checkpoints" / f"step-{step:08d}" / "COMMITTED").exists()
    assert json.loads((run / "manifest.json").read_text())["status"] == "preempted"
    again = run_cli("train", str(run))
    assert again.returncode == 0, again.stdout[-3000:]
    losses = _losses(run)
    for s, loss in reference.items():
        assert losses[s] == pytest.approx(loss, rel=1e-6, abs=1e-7), s


def _trained_rows(run: Path) -> dict[int, list[int]]:
    rows: dict[int, list[int]] = {}
    for trace in sorted((run / "logs").glob("samples-rank-*.jsonl")):
        for line in trace.read_text().splitlines():
            rec = json.loads(line)
            rows.setdefault(rec["step"], []).extend(rec["rows"])
    return rows


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_world_size_change_on_resume_skips_and_repeats_no_sample(tmp_path, before, after):
    runs = tmp_path / "runs"
    first = run_cli("train", *_sets(runs, "train.max_steps=3"), "--nproc", str(before))
    assert first.returncode == 0, first.stdout[-3000:]
    run = only_run(runs)
    second = run_cli("train", str(run), "--nproc", str(after), "--set", "train.max_steps=6",
                     "--set", "checkpoint.allow_spec_change=true")
    assert second.returncode == 0, second.stdout[-3000:]
    rows = _trained_rows(run)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    n_rows = json.loads(next((run.parent.parent / "prepared-cache").glob("*/stats.json")).read_text())
    sampler = StepSampler(n_rows["splits"]["train"]["rows"], 0, global_rows=8, micro_rows=4, world=1)
    for step, got in rows.items():
        expected = np.concatenate([sampler.micro_indices(step - 1, k, 0) for k in range(sampler.accum)])
        assert sorted(got) == sorted(expected.tolist()), step
