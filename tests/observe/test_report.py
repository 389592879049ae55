"""The run report from a run directory alone: resumes split the curves, missing files never break it."""

import json
from pathlib import Path

from PIL import Image

from shardline.cli import main
from shardline.observe.report import (
    PLOTS,
    plot_experts,
    read_records,
    report_is_current,
    write_report,
    write_report_safely,
)
from shardline.rundir import write_manifest


def _train(step: int, **kw) -> dict:
    return {"kind": "train", "time": 1000.0 + step, "step": step, "loss": 3.0 / step, "lr": 1e-3, "grad_norm": 1.0,
            "tokens": 500, "tokens_total": 1000, "step_time_s": 0.5, "data_wait_s": 0.05,
            "tokens_per_s_per_device": 1000.0 + step, "tflops_per_device": 0.1, "mfu": 0.2, "mem_peak_bytes": 2**30,
            **kw}


def _crashed_then_resumed_run(tmp_path: Path) -> Path:
    """Steps 1-6 with a checkpoint at 4, killed, resumed from 4, steps 5-8 — and no summary or eval."""
    run = tmp_path / "tiny-20260101-000000"
    run.mkdir()
    (run / "spec.yaml").write_text("run: {name: tiny}\n")
    records = [{"kind": "event", "event": "setup", "peak_tflops": 1.0, "world": 2, "planned_peak_bytes": 2**30}]
    records += [_train(s, cost_usd=0.01 * s, cost_usd_per_1m_tokens=5.0) for s in range(1, 5)]
    records += [{"kind": "event", "event": "checkpoint", "step": 4, "stall_s": 0.3, "blocking": False},
                {"kind": "event", "event": "checkpoint_committed", "step": 4, "save_s": 0.7},
                {"kind": "eval", "step": 4, "val_loss": 0.9}]
    records += [_train(s) for s in (5, 6)]
    records += [{"kind": "event", "event": "resume", "step": 4, "world": 2, "rng_restored": True, "location": "x"}]
    records += [_train(s) for s in (5, 6, 7, 8)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "tr')
    write_manifest(run, {"run_id": run.name, "status": "running", "versions": {"torch": "2.13.0"}})
    return run


def test_resumes_split_the_curves_into_attempts(tmp_path):
    recs = read_records(_crashed_then_resumed_run(tmp_path) / "metrics.jsonl")
    assert [[r["step"] for r in seg] for seg in recs.segments] == [[1, 2, 3, 4, 5, 6], [5, 6, 7, 8]]
    assert [c["step"] for c in recs.checkpoints] == [4] and recs.checkpoints[0]["save_s"] == 0.7
    assert [r["step"] for r in recs.resumes] == [4] and recs.evals[0]["val_loss"] == 0.9


def test_report_of_a_crashed_resumed_run_renders_every_plot(tmp_path):
    run = _crashed_then_resumed_run(tmp_path)
    page = write_report(run)
    html = page.read_text()
    assert html.count("data:image/png;base64,") == len(PLOTS) and "<script" not in html
    assert "running" in html and "2.13.0" in html and "Resumes" in html and "not yet: the final evaluation" in html
    for name in PLOTS:
        with Image.open(run / "report" / name) as im:
            assert im.size == (880, 374) and len(im.getcolors(1 << 20) or []) > 20, name
    assert report_is_current(run)
    (run / "metrics.jsonl").touch()
    import os

    os.utime(run / "metrics.jsonl", (page.stat().st_mtime + 5,) * 2)
    assert not report_is_current(run)


def test_report_cli_and_failures_that_never_raise(tmp_path, capsys):
    run = _crashed_then_resumed_run(tmp_path)
    assert main(["report", str(run)]) == 0 and "index.html" in capsys.readouterr().out
    assert main(["report", str(tmp_path)]) == 2 and "not a run directory" in capsys.readouterr().err
    said = []
    empty = tmp_path / "empty"
    empty.mkdir()
    # a run that failed during setup logged no step: no report and nothing said (its failure is the message)
    assert write_report_safely(empty, said.append) is None and said == [] and not (empty / "report").exists()


def _train_with_fake_workers(monkeypatch, session_dir, name: str, worker, *extra: str) -> tuple[int, Path]:
    import shardline.engines.local as local
    from tests.conftest import small_overrides

    monkeypatch.setattr(local, "run_local",
                        lambda spec, spec_path, task, run_dir=None, prepared=None: worker(spec_path.parent))
    args = [a for o in [*small_overrides(session_dir / "runs"), f"run.name={name}", "parallel.nproc_per_node=1",
                                  "observe.report=true", *extra]
            for a in ("--set", o)]
    code = main(["train", *args])
    (run,) = [p for p in (session_dir / "runs").iterdir() if p.name.startswith(f"{name}-")]
    return code, run


def test_train_writes_the_report_when_the_workers_died_and_keeps_their_exit_code(monkeypatch, session_dir, prepared):
    def crashed(run_dir: Path) -> int:  # the workers wrote two steps, then died before rank 0's report
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(_train(s)) + "\n" for s in (1, 2)))
        return 1

    code, run = _train_with_fake_workers(monkeypatch, session_dir, "crashed", crashed)
    assert code == 1 and (run / "report" / "index.html").is_file()
    manifest = json.loads((run / "manifest.json").read_text())  # nobody else was left to say it
    assert manifest["status"] == "failed" and manifest["exit_code"] == 1
    assert "the workers exited with code 1" in manifest["failure"]["message"]
    assert "the workers exited with code 1" in (run / "report" / "index.html").read_text()


def test_observe_report_false_writes_no_report(monkeypatch, session_dir, prepared):
    def crashed(run_dir: Path) -> int:
        (run_dir / "metrics.jsonl").write_text(json.dumps(_train(1)) + "\n")
        return 1

    code, run = _train_with_fake_workers(monkeypatch, session_dir, "noreport", crashed, "observe.report=false")
    assert code == 1 and not (run / "report").exists()


def test_a_dpo_run_gets_the_preference_plot_and_an_sft_run_does_not(tmp_path):
    run = _crashed_then_resumed_run(tmp_path)
    write_report(run)
    assert not (run / "report" / "preference.png").exists()
    pref = {"pairs": 8, "loss": 0.6, "accuracy": 0.5, "margin": 0.1, "prefers_chosen": 0.9}
    records = [_train(s, preference={**pref, "accuracy": s / 8, "margin": 0.05 * s}) for s in range(1, 9)]
    records += [{"kind": "eval", "step": s, "val_loss": 0.6, "val_preference": {**pref, "accuracy": s / 10}}
                for s in (0, 4, 8)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    html = write_report(run).read_text()
    assert "DPO: reward accuracy and margin" in html
    with Image.open(run / "report" / "preference.png") as im:
        assert im.size == (880, 374) and len(im.getcolors(1 << 20) or []) > 20


def test_a_mixture_of_experts_run_gets_the_load_per_expert_and_a_dense_run_does_not(tmp_path):
    """The heat map reads each step's expert_tokens (its last record when a resume redid it) and the title the
    imbalance of the first and last step, and with a capacity factor the copies dropped over the run."""
    run = _crashed_then_resumed_run(tmp_path)
    write_report(run)
    assert not (run / "report" / "experts.png").exists()
    records = [{"kind": "event", "event": "setup", "world": 2}]
    records += [_train(s, expert_tokens=[100 + 10 * s, 100, 100 - 10 * s, 100], expert_imbalance=1 + s / 10)
                for s in range(1, 9)]
    records += [{"kind": "event", "event": "resume", "step": 4, "world": 2, "rng_restored": True, "location": "x"}]
    records += [_train(s, expert_tokens=[100, 100, 100, 100], expert_imbalance=1.0) for s in range(5, 9)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    html = write_report(run).read_text()
    assert "Mixture of experts: each expert" in html
    with Image.open(run / "report" / "experts.png") as im:
        assert im.size == (880, 374) and len(im.getcolors(1 << 20) or []) > 20
    fig = plot_experts(read_records(run / "metrics.jsonl"))
    title = fig.axes[0].get_title("left")
    assert "1.10 at step 1" in title and "1.00 at step 8" in title  # step 8 redone after the resume: balanced
    grid = fig.axes[0].images[0].get_array()
    assert grid.shape == (4, 8) and abs(float(grid[0, 0]) - 110 / 400) < 1e-9 and float(grid[0, 7]) == 0.25
    assert "dropped" not in title  # no capacity factor
    for record in records:  # with one: 5 copies dropped a step, 10 in the steps redone after the resume
        if record["kind"] == "train":
            record["expert_dropped"] = 10 if record["expert_imbalance"] == 1.0 else 5
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    title = plot_experts(read_records(run / "metrics.jsonl")).axes[0].get_title("left")
    assert "dropped over capacity: 60 of 3,200 routed copies (1.88 %)" in title
