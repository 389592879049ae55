"""Run ids and run directories: one launch, one directory; an id can never leave `run.dir` or reach a shell."""

import json
from datetime import UTC, datetime

import pytest

from shardline import rundir
from shardline.errors import SpecError
from shardline.spec.resolve import load_spec
from tests.conftest import small_spec


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
