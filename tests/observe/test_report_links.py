"""Files written under a run directory never follow a link planted there (run directories live on shared storage):
a linked report file or temporary is replaced, never written through; a linked `report/` is a named error."""

import json
import os

import pytest

from shardline.cli import main
from shardline.errors import ShardlineError
from shardline.observe.report import write_report
from shardline.spec.resolve import spec_to_yaml
from tests.conftest import small_spec
from tests.observe.test_report import _crashed_then_resumed_run

SOMEONE_ELSES = "someone else's file\n"


def _victim(tmp_path):
    """A file of another run on the same shared storage."""
    victim = tmp_path / "other-run" / "metrics.jsonl"
    victim.parent.mkdir()
    victim.write_text(SOMEONE_ELSES)
    return victim


@pytest.mark.parametrize("planted", ["loss.png", "index.html.tmp", "index.html"])
def test_report_replaces_a_linked_file_and_never_writes_through_it(tmp_path, planted):
    run, victim = _crashed_then_resumed_run(tmp_path), _victim(tmp_path)
    (run / "report").mkdir()
    (run / "report" / planted).symlink_to(victim)
    page = write_report(run)
    assert victim.read_bytes() == SOMEONE_ELSES.encode()
    assert "<html" in page.read_text().lower() and not page.is_symlink()
    assert not (run / "report" / "loss.png").is_symlink() and (run / "report" / "loss.png").stat().st_size > 1000
    assert not [p for p in (run / "report").iterdir() if ".tmp-" in p.name]  # no temporary left behind


def test_a_linked_report_directory_is_a_named_error_and_nothing_is_written(tmp_path):
    run = _crashed_then_resumed_run(tmp_path)
    elsewhere = tmp_path / "other-run" / "report"
    elsewhere.mkdir(parents=True)
    (run / "report").symlink_to(elsewhere)
    with pytest.raises(ShardlineError) as err:
        write_report(run)
    assert err.value.where == str(run / "report") and "symbolic link" in err.value.problem
    assert f"rm {run / 'report'}" in err.value.fix
    assert list(elsewhere.iterdir()) == []


def test_eval_spec_replaces_a_linked_file_and_never_writes_through_it(tmp_path, monkeypatch):
    import shardline.engines.local as local
    import shardline.environment as environment

    spec = small_spec(tmp_path)
    run = tmp_path / "runs" / "tiny-1"
    run.mkdir(parents=True)
    (run / "spec.yaml").write_text(spec_to_yaml(spec))
    victim = _victim(tmp_path)
    (run / "eval-spec.yaml").symlink_to(victim)
    monkeypatch.setattr(environment, "check_environment", lambda *a, **k: None)
    monkeypatch.setattr(local, "run_local", lambda spec, spec_path, task: 0)
    assert main(["eval", str(run)]) == 0
    assert victim.read_bytes() == SOMEONE_ELSES.encode()
    assert not (run / "eval-spec.yaml").is_symlink() and "seq_len" in (run / "eval-spec.yaml").read_text()


def test_write_run_file_creates_subdirectories_and_replaces_atomically(tmp_path):
    from shardline.rundir import write_run_file

    path = write_run_file(tmp_path, "report/data.json", json.dumps({"a": 1}))
    assert path == tmp_path / "report" / "data.json" and json.loads(path.read_text()) == {"a": 1}
    assert write_run_file(tmp_path, "report/data.json", b"{}").read_text() == "{}"
    assert sorted(os.listdir(tmp_path / "report")) == ["data.json"]
