"""Golden runs: SFT, DPO and GRPO, LoRA and full, a few seeded steps each on one in-process rank, equal the losses,
gradient norms and objective metrics recorded before the objectives left the loop (issue 56), and a checkpoint
written by that code (a full DPO run: its precomputed reference table is objective state) still resumes to the
step it recorded.

Equality: gradient norms, DPO's and GRPO's metrics and the validation losses bit-equal. The step loss is the sum of
each micro-batch's share of the global loss (the objectives' convention) where the old loop divided one sum at the
end (SFT: Σ loss_k / tokens, was (Σ loss_k) / tokens; DPO: Σ (pair losses_k / pairs), was their float64 mean), so
the loss may move in its last float64 digits: compared to 1e-15 relative.

On 2 ranks (one torchrun world, `world_worker.py`, each objective's `Trainer.fit` in turn: SFT full, DPO LoRA
with its adapters-off reference, GRPO full with a frozen reference copy) the same holds for the train records of
metrics.jsonl.

Measured at the change (issue 56): GRPO bit-equal everywhere; SFT and DPO step losses equal or one float64 ulp
apart (largest relative difference 2.1e-16), everything else bit-equal.

Regenerate (only when a change is meant to move the numbers; say why in the commit):
    SHARDLINE_WRITE_GOLDEN=1 .venv/bin/python -m pytest tests/train/test_objective_golden.py -p no:randomly
which rewrites golden/objectives.json, golden/objectives-2-ranks.json and golden/dpo-full-checkpoint/.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from shardline.data.prepare import prepare
from shardline.rundir import run_path
from shardline.training.trainer import Trainer
from tests.conftest import REPO, read_metrics, small_spec
from tests.train.world_worker import created, run_world

GOLDEN = Path(__file__).parent / "golden"
WRITE = os.environ.get("SHARDLINE_WRITE_GOLDEN") == "1"
STEPS = 4
LOSS_REL = 1e-15

OBJECTIVES = {
    "sft": [],
    "dpo": ["train.objective=dpo", "train.dpo.beta=0.2", "train.dpo.sft_weight=0.1"],
    "grpo": ["train.objective=grpo", "train.grpo.beta=0.1", "train.grpo.num_generations=4",
             "train.grpo.max_new_tokens=8", "train.grpo.num_iterations=2",
             "train.grpo.reward=tests.train.test_objective_matrix:letters"],
}
FINE_TUNES = {"lora": ["model.lora.enabled=true", "model.lora.r=4"], "full": []}
COMMON = ["train.peak_tflops=1", "checkpoint.async_save=false", "train.micro_batch_size=2", f"train.max_steps={STEPS}",
          "train.warmup_steps=1"]


@pytest.fixture(scope="module")
def preference_data(session_dir):
    return prepare(small_spec(session_dir, *OBJECTIVES["dpo"]))


def _record(record) -> dict:
    return {"step": record.step, "loss": record.loss, "grad_norm": record.grad_norm, "tokens": record.tokens,
            "preference": record.preference, "grpo": _timeless(record.grpo)}


def _timeless(grpo: dict | None) -> dict | None:
    return None if grpo is None else {k: v for k, v in grpo.items() if not k.endswith("_s")}


def _golden() -> dict:
    return json.loads((GOLDEN / "objectives.json").read_text()) if (GOLDEN / "objectives.json").exists() else {}


def _assert_same(got: dict, want: dict, where: str) -> None:
    assert got["loss"] == pytest.approx(want["loss"], rel=LOSS_REL, abs=0), where
    assert {k: v for k, v in got.items() if k != "loss"} == {k: v for k, v in want.items() if k != "loss"}, where


def _write(name: str, value) -> None:
    golden = _golden()
    golden[name] = value
    GOLDEN.mkdir(exist_ok=True)
    (GOLDEN / "objectives.json").write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("fine_tune", sorted(FINE_TUNES))
@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_seeded_steps_equal_the_recorded_golden_run(ctx, tmp_path, prepared, preference_data, objective,
                                                     fine_tune):
    name = f"{objective}-{fine_tune}"
    spec = small_spec(tmp_path, *COMMON, *OBJECTIVES[objective], *FINE_TUNES[fine_tune])
    trainer = Trainer(spec, ctx, preference_data if objective == "dpo" else prepared, tmp_path / "run",
                      Console(quiet=True))
    trainer.begin()
    records = []
    for _ in range(STEPS):
        records.append(_record(trainer.train_step()))
        if objective == "dpo" and fine_tune == "full" and records[-1]["step"] == STEPS - 1 and WRITE:
            trainer.save_checkpoint(blocking=True)
            shutil.rmtree(GOLDEN / "dpo-full-checkpoint", ignore_errors=True)
            shutil.copytree(trainer.checkpointer.store.path(STEPS - 1), GOLDEN / "dpo-full-checkpoint"
                            / f"step-{STEPS - 1:08d}")
    run = {"steps": records, "val_loss": trainer.validate()}
    if WRITE:
        _write(name, run)
        return
    want = _golden()[name]
    for got, expected in zip(run["steps"], want["steps"], strict=True):
        _assert_same(got, expected, f"{name} step {expected['step']}")
    assert run["val_loss"] == want["val_loss"], name


def test_a_checkpoint_written_before_the_objectives_moved_resumes_to_the_recorded_step(ctx, tmp_path,
                                                                                      preference_data):
    """The full DPO run's step-3 checkpoint (weights, optimizer, counters, the precomputed reference table) resumes
    and its next step equals the uninterrupted run's fourth."""
    if WRITE:
        pytest.skip("written by the golden runs")
    store = tmp_path / "old-checkpoints"
    shutil.copytree(GOLDEN / "dpo-full-checkpoint", store)
    spec = small_spec(tmp_path, *COMMON, *OBJECTIVES["dpo"], f"checkpoint.resume_from={store}")
    trainer = Trainer(spec, ctx, preference_data, tmp_path / "run", Console(quiet=True))
    trainer.begin()
    assert trainer.step == STEPS - 1
    want = _golden()["dpo-full"]["steps"][-1]
    _assert_same(_record(trainer.train_step()), want, "resumed step")


TWO_RANKS = {"sft-full": OBJECTIVES["sft"], "dpo-lora": [*OBJECTIVES["dpo"], *FINE_TUNES["lora"]],
             "grpo-full": OBJECTIVES["grpo"]}


def test_two_ranks_equal_the_recorded_golden_runs(tmp_path, monkeypatch):
    """Each objective's `fit` on one 2-rank world: its train records equal the recorded ones."""
    # GRPO's reward is a function of test_objective_matrix: the workers import it from the repository
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    runs = {name: created(tmp_path / name, "parallel.nproc_per_node=2", *COMMON, "train.max_steps=2", *overrides)
            for name, overrides in TWO_RANKS.items()}
    run_world(tmp_path, [{"spec": spec, "fit": True} for spec in runs.values()])
    found = {name: [_record_fields(r) for r in read_metrics(run_path(spec), "train")]
             for name, spec in runs.items()}
    path = GOLDEN / "objectives-2-ranks.json"
    if WRITE:
        path.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
        return
    want = json.loads(path.read_text())
    assert found.keys() == want.keys()
    for name, records in want.items():
        for got, expected in zip(found[name], records, strict=True):
            _assert_same(got, expected, f"{name} on 2 ranks, step {expected['step']}")


def _record_fields(record: dict) -> dict:
    return {"step": record["step"], "loss": record["loss"], "grad_norm": record["grad_norm"],
            "tokens": record["tokens"], "preference": record.get("preference"),
            "grpo": _timeless(record.get("grpo"))}
