"""Multi-process training through the real CLI and torchrun (gloo on CPU). Run one at a time.

Each run starts in its own working directory with a relative `run.dir`, and `shardline train/eval/export RUN_DIR`
act on it from the repository's: the run directory given, from any working directory."""

import json

import pytest
from transformers import AutoModelForCausalLM

from tests.conftest import REPO, only_run, read_metrics, run_cli, small_overrides

pytestmark = pytest.mark.slow


def _train(tmp_path, name, *extra, nproc=2):
    """A run started in `tmp_path/name` with `run.dir=runs`: it lives under the directory it started in."""
    work = tmp_path / name
    work.mkdir()
    sets = [*small_overrides(work / "runs"), "run.dir=runs", *extra]
    out = run_cli("train", *[a for o in sets for a in ("--set", o)], "--nproc", str(nproc), cwd=work)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return only_run(work / "runs"), out.stdout


def test_two_process_fsdp_run_lowers_loss_and_logs_every_field(tmp_path):
    run, stdout = _train(tmp_path, "fsdp", "train.precision=bf16", "train.max_steps=30", "train.eval_every=15",
                         "train.peak_tflops=null",  # the MFU peak probed, as a run without one does
                         "checkpoint.every_steps=10",
                         "train.lr=1e-2", "train.eval_examples=8", "train.eval_max_new_tokens=24")
    train = read_metrics(run, "train")
    assert [r["step"] for r in train] == list(range(1, 31))
    fields = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_total", "step_time_s", "data_wait_s",
              "tokens_per_s_per_device", "tflops_per_device", "mfu", "mem_peak_bytes"}
    assert fields <= set(train[0])
    assert train[-1]["loss"] < 0.75 * train[0]["loss"]
    assert all(0 < r["mfu"] < 1 and r["tokens"] < r["tokens_total"] for r in train)
    evals = read_metrics(run, "eval")
    assert [e["step"] for e in evals if "val_loss" in e] == [15, 30]
    assert any("sql_execution_accuracy" in e for e in evals)
    setup = [e for e in read_metrics(run, "event") if e["event"] == "setup"][0]
    assert setup["world"] == 2 and "probe" in setup["peak_source"]
    assert "MFU (headline) counts model FLOPs = (6·N_trainable" in stdout and "MFU peak" in stdout
    assert all(0 < r["mfu_causal"] < r["mfu"] and r["hfu"] > r["mfu_causal"] for r in train)
    committed = sorted(p.name for p in (run / "checkpoints").iterdir() if (p / "COMMITTED").exists())
    assert committed == ["step-00000010", "step-00000020", "step-00000030"]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "finished" and manifest["world_size"] == 2
    assert (run / "logs" / "rank-1.log").read_text().count("[rank 1]") > 0
    for rank in (0, 1):  # the workers opened the launcher's prepared copy, not preparing (or regenerating) again
        log = (run / "logs" / f"rank-{rank}.log").read_text()
        assert "data: the launcher's prepared copy " in log and f"/{manifest['dataset_version']}\n" in log
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["mean_mfu"] > 0 and summary["grace_needed_s"] > 0
    assert manifest["versions"]["peft"] and manifest["spec"]["train"]["max_steps"] == 30
    assert manifest["dataset_version"] == summary["dataset_version"]
    # planned vs measured, logged: the plan models the training step; the peak RSS is a high-water mark, which the
    # generation at step 15 raises by what the CPU's kernels keep for each new shape (oneDNN's primitives and JIT
    # code on AMX), so the step's own peak is read before it
    training_peak = max(r["mem_peak_bytes"] for r in train if r["step"] < 15)
    # ... and without the steady-state growth of those caches, which 30 steps do not reach (a term of its own)
    terms = summary["mem_planned_terms"]
    assert terms["runtime_source"] == "measured at startup" and terms["growth"] > 0
    early = summary["mem_planned_bytes"] - terms["growth"]
    assert 0.8 < early / training_peak < 1.2, (early, training_peak)
    assert summary["mem_peak_bytes"] >= training_peak
    assert "planned" in stdout and "(measured at startup)" in stdout and "caches and heap growth" in stdout

    # `shardline export` writes a Hugging Face directory that loads with from_pretrained.
    from shardline.cli import main  # in this process: its imports are paid already, a process would pay them again

    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.num_hidden_layers == 2

    # `shardline eval` reruns validation and SQL accuracy from the last checkpoint.
    out = run_cli("eval", str(run), "--nproc", "1", cwd=REPO)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "SQL execution accuracy" in out.stdout and "validation loss" in out.stdout
    after = [e for e in read_metrics(run, "eval") if "val_loss" in e][-1]["val_loss"]
    before = [e for e in evals if "val_loss" in e][-1]["val_loss"]
    # resharded 2 → 1 rank, same weights, bf16: 1 and 2 ranks batch the validation rows differently, so the kernels
    # round each logit differently (bf16 eps 7.8e-3); the mean over ~1k tokens agrees to ~1e-3, bounded at 5e-3
    assert after == pytest.approx(before, rel=5e-3)
    events = [e["event"] for e in read_metrics(run, "event")]
    assert "resume" not in events and events.count("evaluation_restore") == 1  # an evaluation is not a resume
    from shardline.observe.report import read_records

    assert read_records(run / "metrics.jsonl").resumes == []


def test_train_on_a_run_directory_resumes_on_one_rank_with_the_losses_two_ranks_trained(tmp_path):
    """A 2-rank run killed during its final save: `shardline train RUN_DIR` resumes it from the last committed
    checkpoint on one rank (DCP reshards 2 → 1), which accumulates 4 micro-batches where each of the two ranks took 2:
    normalisation must not care, so the global batches give the same tokens, losses, gradient norms and rates."""
    run, _ = _train(tmp_path, "resume", "train.max_steps=6", "checkpoint.every_steps=3", "train.precision=fp32",
                    "train.micro_batch_size=2", "train.global_batch_size=8", nproc=2)
    full = read_metrics(run, "train")
    # Simulate a kill during the final save: step 6 never committed, its records are gone.
    (run / "checkpoints" / "step-00000006" / "COMMITTED").unlink()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(ln for ln in lines if '"step": 4' not in ln and
                                                 '"step": 5' not in ln and '"step": 6' not in ln) + "\n")
    out = run_cli("train", str(run), "--nproc", "1", cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resumed from" in out.stdout and "step 3" in out.stdout
    assert not (REPO / "runs" / run.name).exists()  # not a fresh run under the current directory
    assert [e["step"] for e in read_metrics(run, "event") if e["event"] == "resume"] == [3]
    assert [e["world"] for e in read_metrics(run, "event") if e["event"] == "setup"] == [2, 1]
    resumed = read_metrics(run, "train")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(full[3:], resumed[3:], strict=True):
        assert a["tokens"] == b["tokens"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-9)
    assert resumed[-1]["loss"] < resumed[0]["loss"]
