"""Runs sharing `checkpoint.dir` stay apart; starting from another run is the explicit `checkpoint.resume_from`."""

import pytest
import torch
from rich.console import Console
from torch.distributed.tensor import DTensor

from shardline.checkpointing.manager import CheckpointStore, step_name
from shardline.errors import SpecError
from shardline.spec.resolve import spec_to_yaml
from shardline.training.trainer import Trainer
from tests.conftest import small_spec


def _weights(model) -> torch.Tensor:
    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).flatten() for p in model.parameters()])


def _trainer(ctx, tmp, prepared, run_id: str, *overrides) -> Trainer:
    spec = small_spec(tmp, "train.precision=fp32", "train.peak_tflops=1", "checkpoint.async_save=false",
                      f"run.id={run_id}", *overrides)
    return Trainer(spec, ctx, prepared, tmp / "runs" / run_id, Console(quiet=True))


def _train(trainer: Trainer, steps: int) -> None:
    for _ in range(steps):
        trainer.train_step()
        trainer.save_checkpoint()


def test_runs_sharing_checkpoint_dir_never_resume_or_delete_each_others_checkpoints(ctx, tmp_path, prepared):
    shared = f"checkpoint.dir={tmp_path / 'bucket'}"
    a = _trainer(ctx, tmp_path, prepared, "a", shared, "checkpoint.keep_last=1")
    _train(a, 2)
    b = _trainer(ctx, tmp_path, prepared, "b", shared, "checkpoint.keep_last=1", "train.seed=7")
    b.maybe_resume()  # before: b resumed a's step 2 (or failed: "train.seed changed since the checkpoint")
    assert b.step == 0
    _train(b, 1)  # before: b's retention deleted a's checkpoints
    assert CheckpointStore(str(tmp_path / "bucket" / "a")).committed() == [2]
    assert CheckpointStore(str(tmp_path / "bucket" / "b")).committed() == [1]
    assert a.checkpointer.store.location == str(tmp_path / "bucket" / "a")


def test_resume_from_another_run_directory_or_location_at_a_chosen_step(ctx, tmp_path, prepared):
    a = _trainer(ctx, tmp_path, prepared, "a", "checkpoint.keep_last=3")
    _train(a, 2)
    run_a = tmp_path / "runs" / "a"
    (run_a / "spec.yaml").write_text(spec_to_yaml(a.spec))
    after_2 = _weights(a.model)
    loss_3 = a.train_step().loss

    c = _trainer(ctx, tmp_path, prepared, "c", f"checkpoint.resume_from={run_a}")
    c.maybe_resume()
    assert c.step == 2 and torch.equal(_weights(c.model), after_2)
    assert c.train_step().loss == pytest.approx(loss_3, rel=1e-6)  # optimizer, schedule and data position too
    c.save_checkpoint()
    assert c.checkpointer.store.committed() == [3] and a.checkpointer.store.committed() == [1, 2]

    d = _trainer(ctx, tmp_path, prepared, "d", f"checkpoint.resume_from={run_a / 'checkpoints'}@1")
    d.maybe_resume()
    assert d.step == 1

    e = _trainer(ctx, tmp_path, prepared, "e", f"checkpoint.resume_from={run_a}@5")
    with pytest.raises(SpecError, match="committed step") as err:
        e.maybe_resume()
    assert err.value.where == "checkpoint.resume_from"


def test_own_checkpoints_win_over_resume_from(ctx, tmp_path, prepared):
    a = _trainer(ctx, tmp_path, prepared, "a")
    _train(a, 1)
    c = _trainer(ctx, tmp_path, prepared, "c", f"checkpoint.resume_from={a.checkpointer.store.location}")
    c.maybe_resume()
    _train(c, 2)
    again = _trainer(ctx, tmp_path, prepared, "c", f"checkpoint.resume_from={a.checkpointer.store.location}")
    again.maybe_resume()  # preempted and restarted: continues its own step 3, not a's step 1
    assert again.step == 3
    assert (tmp_path / "runs" / "c" / "checkpoints" / step_name(3)).is_dir()
