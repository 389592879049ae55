"""A stop signal during validation or generation ends it after the current batch; the step is committed once.

The real-process drill (Ctrl-C and SIGTERM in the final validation and SQL evaluation of a 2-rank run) is in
test_preemption.py; this drives one in-process rank to show what happens batch by batch."""

import json
import signal

import pytest
from rich.console import Console

import shardline.training.evaluate as evaluate
from shardline.data.loader import eval_batches
from shardline.resilience.signals import Preempted
from shardline.training.trainer import Trainer
from tests.conftest import read_metrics, small_spec


def _trainer(ctx, tmp, prepared) -> Trainer:
    spec = small_spec(tmp, "train.precision=fp32", "train.peak_tflops=1", "train.eval_examples=4")
    return Trainer(spec, ctx, prepared, tmp / "run", Console(quiet=True))


def _preempted(run) -> list[dict]:
    return [e for e in read_metrics(run, "event") if e["event"] == "preempted"]


def test_a_stop_during_validation_or_generation_abandons_it_after_the_batch_and_commits_the_step_once(
        ctx, tmp_path, prepared, monkeypatch):
    t = _trainer(ctx, tmp_path, prepared)
    run, store = tmp_path / "run", t.checkpointer.store
    t.train_step()
    t.save_checkpoint(blocking=True)
    batches = len(eval_batches(prepared.rows("validation"), t.spec.train.micro_batch_size, 0, 1))
    assert batches > 1
    ran = []
    after_batch = t._after_validation_batch

    def signalled_in_the_first_batch() -> None:
        ran.append(1)
        if len(ran) == 1:
            t.stop._handle(signal.SIGTERM, None)  # what the handler does when the signal arrives
        after_batch()

    t._after_validation_batch = signalled_in_the_first_batch
    with pytest.raises(Preempted):
        t._stoppable(t.validate)
    assert len(ran) == 1  # not the other batches
    assert not read_metrics(run, "eval")  # an abandoned validation leaves no score
    assert store.committed() == [1]  # step 1 was committed already: not saved again
    [stopped] = _preempted(run)
    assert (stopped["step"], stopped["phase"], stopped["signal"]) == (1, "validation", "SIGTERM")

    # The flag still set, a step later: generation stops at its first token, nothing is scored, the step is saved.
    t.train_step()
    lengths = []
    generate = evaluate._generate

    def measured(*args, **kwargs):
        out = generate(*args, **kwargs)
        lengths.extend(len(o) for o in out)
        return out

    monkeypatch.setattr(evaluate, "_generate", measured)
    with pytest.raises(Preempted):
        t._stoppable(t.evaluate_generation)
    assert lengths and max(lengths) <= 1 < t.spec.train.eval_max_new_tokens
    assert not (run / "eval.json").exists()
    assert store.committed() == [1, 2] and store.verify(2) == []
    assert [e["phase"] for e in _preempted(run)] == ["validation", "sql_evaluation"]
    assert json.loads(store.read_text(2, "meta.json"))["step"] == 2
