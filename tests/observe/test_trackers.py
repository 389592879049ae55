"""TensorBoard and W&B get the same records as metrics.jsonl; both off by default, W&B offline by default."""

import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

import pytest

from shardline.environment import check_environment
from shardline.errors import SpecError
from shardline.observe.trackers import TensorBoardSink, WandbSink, scalars
from tests.conftest import small_spec

TMP = Path("/tmp")


def test_trackers_are_off_by_default():
    o = small_spec(TMP).observe
    assert (o.tensorboard, o.wandb_project, o.wandb_mode) == (False, None, "offline")


def test_records_become_named_scalars():
    step, values = scalars("train", {"kind": "train", "time": 1.0, "step": 3, "loss": 0.5, "mfu": 0.2, "flag": True})
    assert step == 3 and values == {"train/loss": 0.5, "train/mfu": 0.2}
    step, values = scalars("event", {"event": "checkpoint", "step": 4, "stall_s": 1.5, "location": "/x"})
    assert step == 4 and values == {"checkpoint/stall_s": 1.5}
    assert scalars("event", {"event": "setup", "peak_tflops": 1.0})[0] is None
    _, values = scalars("train", {"step": 5, "loss": 0.4, "preference": {"accuracy": 0.75, "margin": 0.2}})
    assert values == {"train/loss": 0.4, "train/preference.accuracy": 0.75, "train/preference.margin": 0.2}


def test_tensorboard_event_files_hold_the_step_series(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path / "tb")
    for step in (1, 2, 3):
        sink("train", {"step": step, "loss": 1.0 / step, "time": 100.0 + step})
    sink("eval", {"step": 3, "val_loss": 0.25})
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("train/loss")] == [(1, 1.0), (2, 0.5), (3, 0.3333)]
    assert acc.Scalars("eval/val_loss")[0].value == 0.25


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = {"log": []}
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)

    class Run:
        def log(self, values, step):
            calls["log"].append((step, values))

        def finish(self):
            calls["finished"] = True

    def init(**kwargs):
        calls["init"] = kwargs
        return Run()

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_wandb_is_offline_unless_asked_and_gets_the_spec_and_steps(fake_wandb, tmp_path):
    spec = small_spec(tmp_path, "observe.wandb_project=sql-ft", "run.id=r1")
    sink = WandbSink(spec, tmp_path)
    sink("train", {"step": 1, "loss": 2.0})
    sink.close()
    init = fake_wandb["init"]
    assert (init["project"], init["mode"], init["id"], init["dir"]) == ("sql-ft", "offline", "r1", str(tmp_path))
    assert init["config"]["train"]["max_steps"] == spec.train.max_steps
    assert fake_wandb["log"] == [(1, {"train/loss": 2.0})] and fake_wandb["finished"]
    online = WandbSink(small_spec(tmp_path, "observe.wandb_project=sql-ft", "observe.wandb_mode=online"), tmp_path)
    assert fake_wandb["init"]["mode"] == "online" and online


def test_missing_tracker_packages_are_named_errors_where_training_starts(monkeypatch):
    real = importlib.util.find_spec  # both absent here, whatever this machine has installed
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "tensorboard") else real(name, *a))
    with pytest.raises(SpecError) as err:
        check_environment(small_spec(TMP, "observe.wandb_project=x"))
    assert err.value.where == "observe.wandb_project" and "pip install wandb" in err.value.fix
    with pytest.raises(SpecError) as err:
        check_environment(small_spec(TMP, "observe.tensorboard=true"))
    assert err.value.where == "observe.tensorboard" and "shardline[observe]" in err.value.fix
