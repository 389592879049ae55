"""Run ids and run directories: one launch, one directory; an id can never leave `run.dir` or reach a shell."""

import json
from datetime import UTC, datetime

import pytest

from shardline import rundir
from shardline.errors import SpecError
from shardline.spec.resolve import load_spec
from tests.conftest import LOADED_SLACK_S, small_spec


@pytest.mark.parametrize("bad", ["../../../tmp/x", "a/b", "x$(touch /tmp/p)", "a\nb", "", ".hidden", "a b",
                                 "x" * 101])
def test_run_id_refuses_paths_shell_characters_and_control_characters(bad):
    with pytest.raises(SpecError) as e:
        load_spec("tiny", [f"run.id={json.dumps(bad)}"])  # a YAML double-quoted scalar: "\n" is a newline
    assert e.value.where == "run.id"


def test_two_launches_in_the_same_second_with_the_same_draw_get_different_directories(tmp_path, monkeypatch):
    class FrozenClock(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2026, 11, 23, 12, 0, 0, tzinfo=UTC)

    draws = iter(["aaaa", "aaaa", "bbbb"])  # the second launch draws the first one's id, then another
    monkeypatch.setattr(rundir, "datetime", FrozenClock)
    monkeypatch.setattr(rundir.secrets, "token_hex", lambda n: next(draws))
    spec = small_spec(tmp_path)
    first, first_dir = rundir.create_run(spec)
    second, second_dir = rundir.create_run(spec)
    assert first.run.id == "tiny-20261123-120000-aaaa" and second.run.id == "tiny-20261123-120000-bbbb"
    assert first_dir != second_dir and (first_dir / "spec.yaml").is_file() and (second_dir / "spec.yaml").is_file()


def test_each_attempt_keeps_its_own_spec_and_the_fields_it_changed(tmp_path):
    first, run_dir = rundir.create_run(small_spec(tmp_path, "observe.metrics_port=9100"))
    again = small_spec(tmp_path, f"run.id={first.run.id}", "observe.metrics_port=9200")  # port taken on restart
    rundir.create_run(again)
    manifest = rundir.read_manifest(run_dir)
    assert [a["attempt"] for a in manifest["attempts"]] == [1, 2]
    assert manifest["attempts"][0]["changed"] == [] and manifest["attempts"][1]["changed"] == ["observe.metrics_port"]
    ports = [rundir.read_spec(run_dir / a["spec_file"]).observe.metrics_port for a in manifest["attempts"]]
    assert ports == [9100, 9200]  # before: the resume overwrote the first attempt's spec
    assert rundir.read_spec(run_dir / "spec.yaml").observe.metrics_port == 9200


def test_a_relative_checkpoint_dir_is_resolved_where_the_run_was_created(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec, run_dir = rundir.create_run(small_spec(tmp_path, "checkpoint.dir=ckpt", "checkpoint.keep_last=2"))
    assert spec.checkpoint.dir == str(tmp_path / "ckpt")
    assert rundir.read_spec(run_dir / "spec.yaml").checkpoint.dir == str(tmp_path / "ckpt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the run's spec, read from anywhere, still names the same checkpoints
    again, _ = rundir.create_run(rundir.read_spec(run_dir / "spec.yaml"))
    assert rundir.checkpoint_location(again, run_dir) == f"{tmp_path / 'ckpt'}/{run_dir.name}"
    remote, _ = rundir.create_run(small_spec(tmp_path, "checkpoint.dir=gs://bucket/ckpt"))
    assert remote.checkpoint.dir == "gs://bucket/ckpt"


def test_writers_with_the_same_pid_on_a_shared_mount_never_collide(tmp_path, monkeypatch):
    # pods and Vertex replicas all run their wrapper as pid 1; a pid-named temp file made two nodes writing
    # `failed` rename each other's file (FileNotFoundError traceback, exit 1)
    import threading

    monkeypatch.setattr(rundir.os, "getpid", lambda: 1)
    errors: list[BaseException] = []

    def write(n: int) -> None:
        try:
            for i in range(200):
                rundir.write_manifest(tmp_path, {"status": "failed", "writer": n, "i": i})
        except BaseException as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert json.loads((tmp_path / "manifest.json").read_text())["status"] == "failed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]  # no temporary file left behind


def test_a_run_directory_under_a_path_with_a_yaml_comment_is_loaded_as_that_run(tmp_path):
    # `--set run.dir=/data/a #1` cut the path at the comment: `shardline train RUN_DIR` started a new run elsewhere
    from shardline.api import Spec

    runs = tmp_path / "exp #1: 'lr' [a, b]"
    spec, run_dir = rundir.create_run(Spec.load("tiny", {"run.dir": str(runs)}))
    assert run_dir.parent == runs
    loaded = Spec.load(run_dir)
    assert (loaded.run.dir, loaded.run.id) == (str(run_dir.parent), run_dir.name)
    assert rundir.run_path(loaded) == run_dir


def test_the_launcher_that_claims_a_run_keeps_a_heartbeat_with_its_host_and_pid(tmp_path, monkeypatch):
    # other hosts sharing the run directory cannot see this pid: the heartbeat's age is what they can read
    import os
    import socket
    import time

    monkeypatch.setattr(rundir, "HEARTBEAT_EVERY_S", 0.1)
    _, run_dir = rundir.create_run(small_spec(tmp_path))
    rundir.claim_run(run_dir)
    beat_file = run_dir / ".launcher.heartbeat"
    beat = json.loads(beat_file.read_text())
    assert (beat["host"], beat["pid"]) == (socket.gethostname(), os.getpid())
    stale = time.time() - 3600
    os.utime(beat_file, (stale, stale))
    # an ordering, not an age: the file is rewritten after it was made stale (10 s is 100 beats; a loaded machine
    # only makes the wait longer, up to the slack)
    deadline = time.monotonic() + 10 + LOADED_SLACK_S
    while beat_file.stat().st_mtime <= stale and time.monotonic() < deadline:
        time.sleep(0.1)
    assert beat_file.stat().st_mtime > stale  # beaten again while the launcher lives
