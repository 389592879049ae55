"""The Python API: the walk-through in docs/python-api.md runs as written, the public module type-checks, and
nothing in it prints or exits — failures are exceptions with the field and the fix."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import time

import pytest

import shardline
from shardline import api
from tests.conftest import LOADED_SLACK_S, REPO

DOC = REPO / "docs" / "python-api.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


def test_every_public_name_is_exported_documented_and_resolves():
    assert set(shardline.__all__) == set(api.__all__) | {"__version__"}
    for name in api.__all__:
        assert getattr(shardline, name) is getattr(api, name)
        assert f"`{name}" in DOC.read_text() or name in ("Plan", "Rendered", "RunState", "RunStatus", "DataError",
                                                          "ClusterError", "ShardlineError", "SpecError"), name
    with pytest.raises(AttributeError):
        shardline.no_such_name  # noqa: B018


def test_the_public_module_type_checks_with_mypy(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mypy", f"--cache-dir={tmp_path / 'cache'}", "src/shardline/api.py",
                          "src/shardline/__init__.py"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Success: no issues found in 2 source files" in out.stdout


def test_failures_are_exceptions_with_the_field_and_nothing_is_printed(tmp_path, capsys):
    with pytest.raises(shardline.SpecError) as bad:
        shardline.Spec.load("tiny", overrides={"train.lr": -1.0})
    assert bad.value.field == "train.lr" and bad.value.fix
    with pytest.raises(shardline.SpecError) as unknown:
        shardline.Spec.load("tiny", overrides={"train.no_such_knob": 1})
    assert unknown.value.field == "train.no_such_knob" and "fields of 'train'" in unknown.value.fix
    with pytest.raises(shardline.SpecError):
        shardline.Run.open(tmp_path / "nowhere")
    with pytest.raises(shardline.SpecError) as target:
        shardline.render(shardline.Spec.load("tiny"), "no-such-engine")
    assert target.value.field == "--target" and "jobset" in target.value.fix
    spec = shardline.Spec.load("tiny", overrides={"train.lr": 2e-5, "train.max_steps": 9})
    assert isinstance(spec.train.lr, float) and spec.train.lr == 2e-5  # a typed value, not YAML text
    assert spec.with_overrides({"train.max_steps": 3}).train.max_steps == 3 and spec.train.max_steps == 9
    assert shardline.Spec.load(None, ["train.max_steps=4"]).train.max_steps == 4
    assert "max_steps: 9" in spec.to_yaml()
    assert capsys.readouterr() == ("", "")


def test_wait_on_a_live_run_raises_timeout_and_status_reads_the_run(tmp_path):
    from shardline.run_status import record_process
    from shardline.rundir import create_run, update_manifest
    from tests.conftest import small_spec

    _, run_dir = create_run(small_spec(tmp_path))
    update_manifest(run_dir, status="running")
    record_process(run_dir, os.getpid(), "launcher")  # alive: this test
    run = shardline.Run.open(run_dir)
    assert run.target == "local" and run.id == run_dir.name
    state = run.status()
    assert state.phase == "running" and state.run is not None and state.run.max_steps == 6 and not state.done
    started, wait_s = time.monotonic(), 0.5
    with pytest.raises(TimeoutError, match="still running"):
        run.wait(timeout=wait_s, poll=0.1)
    assert wait_s <= time.monotonic() - started < wait_s + LOADED_SLACK_S  # its timeout ended it: the run never does
    update_manifest(run_dir, status="finished", exit_code=0)
    assert run.wait(timeout=5, poll=0.1).phase == "succeeded"
    assert [r.run_id for r in shardline.runs(tmp_path / "runs")] == [run_dir.name]


def test_launching_a_live_run_again_is_refused_by_the_cli_and_the_api(tmp_path, monkeypatch, capsys):
    # `shardline train RUN` was the only path tested; `launch RUN --target local` and `shardline.train`/`launch` ask
    # the same question in the local engine's submit
    from shardline.cli import main
    from shardline.engines import local
    from shardline.run_status import record_process
    from shardline.rundir import create_run, read_manifest, update_manifest
    from tests.conftest import small_spec

    popen = subprocess.Popen

    def no_second_launcher(cmd, *args, **kwargs):
        assert "shardline.engines.local" not in cmd, f"a second launcher was started for a live run: {cmd}"
        return popen(cmd, *args, **kwargs)

    monkeypatch.setattr(local.subprocess, "Popen", no_second_launcher)  # a missed refusal fails here, trains nothing
    _, run_dir = create_run(small_spec(tmp_path))
    update_manifest(run_dir, status="running")
    record_process(run_dir, os.getpid(), "launcher")  # alive: this test
    before = read_manifest(run_dir)
    assert main(["launch", str(run_dir), "--target", "local"]) == 2
    err = capsys.readouterr().err
    assert f"{run_dir}: is still running: launcher (pid {os.getpid()})" in err and "shardline cancel" in err, err
    spec = shardline.Spec.load(run_dir)
    for attempt in (lambda: shardline.train(spec), lambda: shardline.launch(spec, "local")):
        with pytest.raises(shardline.SpecError, match="is still running: launcher") as refused:
            attempt()
        assert refused.value.field == str(run_dir) and "shardline wait" in refused.value.fix
    assert read_manifest(run_dir) == before
    assert capsys.readouterr() == ("", "")  # the API printed nothing


@pytest.mark.slow
def test_the_walk_through_in_docs_runs_as_written(tmp_path, monkeypatch):
    blocks = _blocks()
    assert len(blocks) >= 5
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in blocks:
            exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102 - the documentation is the test
    printed = out.getvalue()
    run = namespace["run"]
    assert run.status().phase == "succeeded"
    assert len(namespace["steps"]) == 6 and namespace["committed"] == [3, 6]
    assert "refused: train.global_batch_size" in printed
    assert "succeeded · step 6/6" in printed and "goodput " in printed and "startup" in printed
    assert namespace["jobset"]["kind"] == "JobSet" and "B200" in printed
    assert (tmp_path / "runs" / run.id / "report" / "index.html").is_file()
