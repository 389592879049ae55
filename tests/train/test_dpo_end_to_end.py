"""DPO through the real trainer and launcher on the generated text-to-SQL pairs (`train.objective: dpo`):

- a full fine-tune on 2 ranks with the reference precomputed: its preference metrics per step and on the held-out
  pairs, the SQL evaluation after it, and a run started from its step-3 checkpoint on 1 rank that trains steps 4-6
  to the same losses: the reference table comes back from the checkpoint (recomputed from the step-3 weights, the
  losses would differ), and the loss is the mean over the global batch's pairs whatever the world size; `shardline
  eval` of it scores the held-out pairs against the same table;
- LoRA in bf16 (the default precision) on 2 ranks with the adapters-off reference: a kill -9 of a rank after step
  3 (the last checkpoint step 2's): torchrun restarts the ranks, which train step 3 again to the same loss, and the
  merged export loads in transformers. The adapters-off forward is the first of the run (the step-0 validation, and
  step 3's after the restart): FSDP2 must still cast the bf16 gradients to the fp32 adapters (issue 52).
"""

import json

import pytest
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM

from shardline.data.prepare import prepare
from shardline.rundir import create_run
from shardline.spec.resolve import load_spec
from shardline.training.trainer import Trainer
from tests.conftest import cli_in_background, kill_the_stopped_worker, only_run, read_metrics, run_cli, small_overrides

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa")
DPO = ["train.objective=dpo", "train.dpo.beta=0.2", "train.lr=1e-3", "observe.metrics_port=null",
       "observe.report=false", "train.eval_every=3", "data.train_size=200", "data.validation_size=16",
       "train.seq_len=384", "model.arch.max_position_embeddings=384"]


def _train(runs, *extra: str, target: str = "tiny"):
    sets = [*small_overrides(runs), *DPO, *extra]
    proc = run_cli("train", target, *[a for kv in sets for a in ("--set", kv)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return only_run(runs), proc.stdout


def _fit(ctx, runs, *extra: str):
    """The Trainer's whole run in this process, on the test session's one rank; its printed lines."""
    spec, run = create_run(load_spec("tiny", [*small_overrides(runs), *DPO, *extra]))
    console = Console(record=True, width=200)
    Trainer(spec, ctx, prepare(spec), run, console).fit()
    return run, console.export_text()


def _losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run, "train")}


@pytest.mark.slow
def test_full_dpo_with_a_precomputed_reference_resumes_on_another_world_size(ctx, tmp_path):
    run_a, out = _train(tmp_path / "a", "parallel.nproc_per_node=2", "checkpoint.every_steps=3",
                        "train.eval_examples=4")
    assert "DPO reference: log-probabilities of" in out
    spec = (run_a / "spec.yaml").read_text()
    assert "format: preference" in spec  # the generated set, drawn as pairs
    records = read_metrics(run_a, "train")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    first, last = records[0]["preference"], records[-1]["preference"]
    assert first["pairs"] == 8 and records[0]["loss"] == pytest.approx(0.693147, abs=1e-5)  # policy = reference
    assert last["margin"] > 0 and last["accuracy"] > 0.5, last  # the policy moves towards the chosen queries
    evals = [e for e in read_metrics(run_a, "eval") if "val_preference" in e]
    assert [e["step"] for e in evals] == [0, 3, 6] and evals[-1]["val_preference"]["pairs"] > 0
    assert evals[-1]["val_loss"] == evals[-1]["val_preference"]["loss"]
    assert "sql_execution_accuracy" in json.loads((run_a / "eval.json").read_text())
    assert [e["event"] for e in read_metrics(run_a, "event")].count("reference_logps") == 1

    # `shardline eval` of the finished run scores the held-out pairs against the same reference table
    proc = run_cli("eval", str(run_a))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = [e for e in read_metrics(run_a, "eval") if "val_preference" in e][-1]["val_preference"]
    assert again["loss"] == pytest.approx(evals[-1]["val_preference"]["loss"], rel=1e-6)
    assert again["margin"] == pytest.approx(evals[-1]["val_preference"]["margin"], rel=1e-5)

    # the resume on 1 rank in this process: the Trainer is what continues the table, the launch is run_a's
    run_b, out = _fit(ctx, tmp_path / "b", "parallel.nproc_per_node=1", f"checkpoint.resume_from={run_a}@3")
    assert "DPO reference" not in out
    resumed, losses = _losses(run_b), _losses(run_a)
    assert sorted(resumed) == [4, 5, 6]
    for step in resumed:
        assert resumed[step] == pytest.approx(losses[step], rel=1e-5, abs=1e-6), (step, resumed, losses)


@pytest.mark.slow
def test_bf16_lora_dpo_with_the_adapters_off_reference_retrains_lost_steps_exactly_after_a_kill_9_and_merges(
        tmp_path):
    runs = tmp_path / "runs"
    lora = ["parallel.nproc_per_node=2", "model.lora.enabled=true", "model.lora.r=8", "model.lora.alpha=16",
            "train.precision=bf16",
            "checkpoint.every_steps=2", "train.max_steps=4", "train.eval_examples=0", "launch.max_restarts=1"]
    sets = [*small_overrides(runs), *DPO, *lora]
    # rank 1 stops itself before step 4 (its first start only) and is killed with SIGKILL there: step 2 is the last
    # committed checkpoint, so torchrun's restart trains step 3 again, then step 4
    with cli_in_background("train", "tiny", *[a for kv in sets for a in ("--set", kv)],
                           fault="train_step:rank=1:step=4:restart=0:action=stop") as proc:
        run = kill_the_stopped_worker(runs, proc, after_step=3)
        out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-6000:]
    assert "DPO reference" not in out  # the adapters off, no table
    trained = read_metrics(run, "train")
    assert [r["step"] for r in trained] == [1, 2, 3, 3, 4]
    assert trained[0]["loss"] == pytest.approx(0.693147, abs=1e-5) and trained[-1]["loss"] < trained[0]["loss"]
    assert trained[3]["loss"] == pytest.approx(trained[2]["loss"], rel=1e-6)  # step 3 again, after the restart
    assert trained[3]["grad_norm"] == pytest.approx(trained[2]["grad_norm"], rel=1e-5)
    assert [e["step"] for e in read_metrics(run, "event") if e["event"] == "resume"] == [2]

    merged = tmp_path / "merged"
    from shardline.cli import main  # in this process: its imports are paid already, a process would pay them again

    assert main(["export", str(run), "--out", str(merged), "--merge-lora"]) == 0
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    assert not any("lora" in name for name, _ in model.named_parameters())


def test_dpo_on_a_users_preference_file_with_no_task(ctx, tmp_path):
    """The main use: the user's own prompt/chosen/rejected JSONL (`data.format: auto` finds `preference`), no task
    metric: the held-out pairs are scored, and the sample generations show the chosen completion as the reference.
    The Trainer's whole run in this process, on one rank: the launch and two ranks are the tests above."""
    rows = [{"prompt": f"Q{i}: say {w}?", "chosen": f" {w}.", "rejected": f" {WORDS[(i + 1) % len(WORDS)]}."}
            for i, w in enumerate(WORDS * 8)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run, out = _fit(ctx, tmp_path / "runs", f"data.path={path}", "data.task=none", "data.test_size=0",
                    "data.validation_size=8", "train.max_steps=3", "train.eval_every=3", "train.sample_generations=2",
                    "train.eval_max_new_tokens=4", "parallel.nproc_per_node=1")
    assert "DPO reference: log-probabilities of 80 pairs" in out  # 72 training and 8 held-out pairs
    evals = [e for e in read_metrics(run, "eval") if "val_preference" in e]
    assert [e["step"] for e in evals] == [0, 3] and evals[0]["val_preference"]["pairs"] == 8
    samples = json.loads((run / "eval.json").read_text())["samples"]
    assert len(samples) == 2 and all(s["gold"] in {r["chosen"] for r in rows} for s in samples)
