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
from shardline.rundir import read_manifest
from tests.conftest import REPO, cli_in_background, only_run, read_metrics, small_overrides, the_stopped_worker
from tests.faults.conftest import MATRIX

pytestmark = pytest.mark.slow
STEPS = 12
EVERY = 4
COMMON = ["train.precision=fp32", f"train.max_steps={STEPS}", "train.lr=1e-2", f"checkpoint.every_steps={EVERY}"]


def _args(runs: Path, *extra: str) -> list[str]:
    return ["train", *[a for o in [*small_overrides(runs, shared_cache=False), *COMMON, *extra] for a in ("--set", o)],
            "--nproc", "2"]  # its own prepared data: one drill deletes it


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


def _matches_the_reference(run: Path, reference: dict[int, float]) -> None:
    """Every step trained so far, by every attempt, has the uninterrupted run's loss."""
    for r in read_metrics(run, "train"):
        assert r["loss"] == pytest.approx(reference[r["step"]], rel=1e-6, abs=1e-7), r["step"]


def _resume_continues_exactly(run: Path, reference: dict[int, float], resumed_at: int, *sets: str) -> str:
    """`shardline train RUN_DIR [--set …]` resumes at `resumed_at`, trains to the end and every step's loss equals
    the uninterrupted run's; returns what the resumed run printed."""
    again = _cli("train", str(run), *[a for o in sets for a in ("--set", o)])
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    resumes = [e for e in read_metrics(run, "event") if e["event"] == "resume"]
    assert resumes[-1]["step"] == resumed_at and resumes[-1]["rng_restored"]
    assert sorted(_losses(run)) == list(range(1, STEPS + 1))
    _matches_the_reference(run, reference)
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


def test_data_deleted_mid_run_then_kill_9_inside_a_checkpoint_write_then_a_corrupted_shard(tmp_path, reference):
    """Three faults one after another in one run, each keeping the last good checkpoint, and each resume continues
    exactly; the last resume also finds its metrics port taken."""
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
    MATRIX.append(("prepared data directory deleted after step 4", "named error naming the directory at its next "
                   "read (the save of step 8), exit 2", "step 4; the resume prepares the same dataset version "
                   "again and continues exactly"))

    # its resume: rank 1 stops itself inside the save of step 12 (its shard files on disk, the save not finished)
    with cli_in_background("train", str(run), fault=f"checkpoint_write:rank=1:step={STEPS}:action=stop") as proc:
        _, victim = the_stopped_worker(runs, proc)
        in_flight = run / "checkpoints" / step_name(STEPS)
        assert list(in_flight.glob("__1_*.distcp")), "the kill must land inside the write"
        assert not (in_flight / ".metadata").exists() and not (in_flight / "COMMITTED").exists()
        os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out[-3000:]
    [resume] = [e for e in read_metrics(run, "event") if e["event"] == "resume"]
    assert resume["step"] == EVERY and resume["rng_restored"]
    assert (cache / read_manifest(run)["dataset_version"]).is_dir()  # prepared again, the same version
    _matches_the_reference(run, losses)  # steps 5-11 on it
    assert _store(run).committed() == [EVERY, 2 * EVERY] and _store(run).verify(2 * EVERY) == []
    MATRIX.append(("kill -9 of rank 1 inside the write of step 12 (SIGSTOP there first)",
                   "the save never commits; torchrun stops the job", "step 8, checksums intact"))

    shard = next((run / "checkpoints" / step_name(2 * EVERY)).glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: DCP alone would load it silently
    shard.write_bytes(bytes(data))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        printed = _resume_continues_exactly(run, losses, EVERY, f"observe.metrics_port={taken.getsockname()[1]}")
    assert f"{step_name(2 * EVERY)} is damaged and was skipped" in printed
    assert "metrics endpoint not started" in printed and _store(run).latest() == STEPS
    MATRIX.append(("one byte of the committed shard of step 8 flipped",
                   "checksum mismatch found at resume; a warning names the file",
                   "resume falls back to step 4 and continues exactly"))
    MATRIX.append(("observe.metrics_port already taken (that resume)", "a warning; training runs without /metrics",
                   "everything: same losses, all checkpoints"))


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
