"""Faults injected into real 2-process torchrun runs: the last good checkpoint survives and a resumed run
continues exactly (same loss at every step as a run that never failed)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardline.checkpointing.manager import CheckpointStore, step_name
from tests.conftest import REPO, cli_in_background, only_run, read_metrics, small_overrides, the_stopped_worker
from tests.faults.conftest import MATRIX

pytestmark = pytest.mark.slow
STEPS = 12
EVERY = 4
COMMON = ["train.precision=fp32", f"train.max_steps={STEPS}", "train.lr=1e-2", f"checkpoint.every_steps={EVERY}"]


def _args(runs: Path, *extra: str) -> list[str]:
    return ["train", *[a for o in [*small_overrides(runs), *COMMON, *extra] for a in ("--set", o)], "--nproc", "2"]


def _env(fault: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SHARDLINE_FAULT"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    if fault:
        env["SHARDLINE_FAULT"] = fault
    return env


def _cli(*args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardline.cli", *args], cwd=REPO, env=_env(fault),
                          capture_output=True, text=True, timeout=600)


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run, "train")}


def _resume_continues_exactly(run: Path, reference: dict[int, float], resumed_at: int) -> str:
    """`shardline train RUN_DIR` resumes at `resumed_at` and every step's loss equals the uninterrupted run's;
    returns what the resumed run printed."""
    again = _cli("train", str(run))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    resumes = [e for e in read_metrics(run, "event") if e["event"] == "resume"]
    assert resumes[-1]["step"] == resumed_at and resumes[-1]["rng_restored"]
    losses = _losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-6, abs=1e-7), step
    return again.stdout + again.stderr


def _store(run: Path) -> CheckpointStore:
    return CheckpointStore(str(run / "checkpoints"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict[int, float], int]:
    """Losses of the uninterrupted run, and the size in bytes of one of its checkpoints."""
    runs = tmp_path_factory.mktemp("reference")
    out = _cli(*_args(runs))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = only_run(runs)
    size = sum(p.stat().st_size for p in (run / "checkpoints" / step_name(STEPS)).rglob("*") if p.is_file())
    return _losses(run), size


def test_kill_9_of_a_rank_inside_a_checkpoint_write_keeps_the_last_good_one(tmp_path, reference):
    losses, _ = reference
    runs = tmp_path / "runs"
    # rank 1 stops itself inside the save of step 8: its shard files are on disk, the save is not finished
    with cli_in_background(*_args(runs), fault=f"checkpoint_write:rank=1:step={2 * EVERY}:action=stop") as proc:
        run, victim = the_stopped_worker(runs, proc)
        in_flight = run / "checkpoints" / step_name(2 * EVERY)
        assert list(in_flight.glob("__1_*.distcp")), "the kill must land inside the write"
        assert not (in_flight / ".metadata").exists() and not (in_flight / "COMMITTED").exists()
        os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out[-3000:]
    assert _store(run).committed() == [EVERY] and _store(run).verify(EVERY) == []
    _resume_continues_exactly(run, losses, resumed_at=EVERY)
    MATRIX.append(("kill -9 of rank 1 inside the write of step 8 (SIGSTOP there first)",
                   "the save never commits; torchrun stops the job",
                   "step 4, checksums intact; the resume continues exactly"))


@pytest.fixture
def small_filesystem(tmp_path, reference):
    """A tmpfs that holds one checkpoint and a half, not two."""
    _, size = reference
    mount = tmp_path / "ckpt-fs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size * 1.5)}", "tmpfs", str(mount)], check=True)
    yield mount, size
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_checkpoint_filesystem_is_a_named_error_and_keeps_the_last_good_one(tmp_path, reference,
                                                                                   small_filesystem):
    losses, _ = reference
    mount, size = small_filesystem
    runs = tmp_path / "runs"
    out = _cli(*_args(runs, f"checkpoint.dir={mount}"))
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "no space left on the device while writing the checkpoint of step 8" in text
    assert "step 4" in text and "is intact" in text
    run = only_run(runs)
    store = CheckpointStore(str(mount / run.name))
    assert store.committed() == [EVERY] and store.steps() == [EVERY]  # the torn step 8 was removed
    assert store.verify(EVERY) == []
    subprocess.run(["mount", "-o", f"remount,size={int(size * 4)}", str(mount)], check=True)
    _resume_continues_exactly(run, losses, resumed_at=EVERY)
    MATRIX.append(("checkpoint filesystem full at step 8 (tmpfs of 1.5 checkpoints)",
                   "named error, exit 2; the torn step is deleted",
                   "step 4, intact; after freeing space the resume continues exactly"))


def test_a_shard_corrupted_after_commit_is_detected_and_resume_falls_back(tmp_path, reference):
    losses, _ = reference
    runs = tmp_path / "runs"
    out = _cli(*_args(runs), fault=f"train_step:step={2 * EVERY + 2}")  # fails after step 8 committed
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    run = only_run(runs)
    assert _store(run).committed() == [EVERY, 2 * EVERY]
    shard = next((run / "checkpoints" / step_name(2 * EVERY)).glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: DCP alone would load it silently
    shard.write_bytes(bytes(data))
    printed = _resume_continues_exactly(run, losses, resumed_at=EVERY)
    assert f"{step_name(2 * EVERY)} is damaged and was skipped" in printed
    MATRIX.append(("one byte of a committed shard flipped",
                   "checksum mismatch found at resume; a warning names the file",
                   "resume falls back to step 4 and continues exactly"))


def test_a_taken_metrics_port_never_stops_training(tmp_path, reference):
    losses, _ = reference
    runs = tmp_path / "runs"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _cli(*_args(runs, f"observe.metrics_port={port}"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "metrics endpoint not started" in out.stdout + out.stderr
    run = only_run(runs)
    assert _store(run).latest() == STEPS
    assert _losses(run) == pytest.approx(losses, rel=1e-6, abs=1e-7)
    MATRIX.append(("observe.metrics_port already taken", "a warning; training runs without /metrics",
                   "everything: same losses, all checkpoints"))


def test_prepared_data_deleted_mid_run_is_a_named_error_and_the_resume_prepares_it_again(tmp_path, reference):
    losses, _ = reference
    runs = tmp_path / "runs"
    with cli_in_background(*_args(runs)) as proc:
        deadline, run = time.monotonic() + 300, None
        while True:  # delete the prepared data once step 4 is committed and before step 8 is saved
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the drill"
            run = next((p.parent for p in runs.glob("*/metrics.jsonl")), None)
            if run and (run / "checkpoints" / step_name(EVERY) / "COMMITTED").exists():
                break
            time.sleep(0.02)
        cache = tmp_path / "prepared-cache"
        shutil.rmtree(cache)
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out[-3000:]
    assert "the prepared data has no" in out and str(cache) in out
    assert _store(run).committed() == [EVERY] and _store(run).verify(EVERY) == []
    _resume_continues_exactly(run, losses, resumed_at=EVERY)
    MATRIX.append(("prepared data directory deleted after step 4", "named error naming the directory at its next "
                   "read (the save of step 8), exit 2", "step 4; the resume prepares the same dataset version "
                   "again and continues exactly"))
