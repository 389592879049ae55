"""`shardline train RUN_DIR` and `shardline eval RUN_DIR` act on the directory given, from any working directory."""

import pytest

from tests.conftest import REPO, only_run, read_metrics, run_cli, small_overrides


@pytest.mark.slow
def test_train_and_eval_of_a_run_directory_work_from_another_working_directory(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    sets = [*small_overrides(tmp_path / "runs"), "run.dir=runs", "parallel.nproc_per_node=2", "train.max_steps=2",
            "train.warmup_steps=0", "observe.metrics_port=null", "observe.report=false"]
    first = run_cli("train", "tiny", *[a for kv in sets for a in ("--set", kv)], cwd=work)
    assert first.returncode == 0, first.stderr[-2000:]
    run_dir = only_run(work / "runs")  # run.dir is relative: the run lives under the directory it started in
    more = run_cli("train", str(run_dir), "--set", "train.max_steps=4", "--set", "checkpoint.allow_spec_change=true",
                   cwd=REPO)
    assert more.returncode == 0, more.stderr[-2000:]
    assert not (REPO / "runs" / run_dir.name).exists()  # not a fresh run under the current directory
    resumes = [r for r in read_metrics(run_dir, "event") if r.get("event") == "resume"]
    assert [r["step"] for r in resumes] == [2]
    assert [r["step"] for r in read_metrics(run_dir, "train")] == [1, 2, 3, 4]
    evaluated = run_cli("eval", str(run_dir), cwd=REPO)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert "validation loss" in evaluated.stdout
