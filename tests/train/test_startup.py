"""Where a run's start-up goes: the setup event's `startup_s` and the `start-up:` line (the 8B start on a GPU host
is 42 s, and a lent GPU window has no time to profile it separately)."""

from __future__ import annotations

import json

from rich.console import Console

from shardline.clock import Laps
from shardline.procfs import process_age
from shardline.training.trainer import Trainer
from tests.conftest import small_spec

PHASES = ["process start to trainer", "model on meta", "parallelize", "weights", "objective", "optimizer",
          "rest of setup"]


def test_the_setup_event_times_each_part_of_the_start_up(ctx, session_dir, prepared):
    run_dir = session_dir / "runs" / "startup"
    trainer = Trainer(small_spec(session_dir), ctx, prepared, run_dir, Console(quiet=True))
    trainer.describe()
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    startup = next(e for e in events if e.get("event") == "setup")["startup_s"]
    assert list(startup) == PHASES and all(s >= 0 for s in startup.values())
    # the laps follow each other: together no longer than this process has lived, the first its age at the start
    assert sum(startup.values()) <= process_age() + 0.1
    assert startup["process start to trainer"] > 1.0  # at least the imports of torch and transformers


def test_the_workers_laps_come_first_and_the_trainer_continues_them(ctx, session_dir, prepared):
    # the worker times its own parts (imports, process group, run directory, data) and hands the stopwatch over
    worker = Laps()
    worker.seconds["imports and spec"] = 4.0
    worker.lap("process group")
    run_dir = session_dir / "runs" / "startup-worker"
    Trainer(small_spec(session_dir), ctx, prepared, run_dir, Console(quiet=True), startup=worker).describe()
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    startup = next(e for e in events if e.get("event") == "setup")["startup_s"]
    assert list(startup) == ["imports and spec", "process group", "tokenizer", *PHASES[1:]]
    assert startup["imports and spec"] == 4.0


def test_laps_add_up_and_read_for_people():
    laps = Laps()
    laps.lap("a")
    laps.seconds["b"] = 12.0
    laps.lap("a")
    assert list(laps.seconds) == ["a", "b"] and laps.seconds["a"] >= 0
    assert laps.line().endswith("b 12s") and laps.line().startswith("a 0.0s")
