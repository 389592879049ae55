"""metrics.jsonl readers: a torn last line (a killed writer) is skipped, and the tail reader parses each line once."""

import json

from shardline.goodput import goodput_fields
from shardline.jsonl import JsonlTail, read_jsonl


def test_a_torn_last_line_is_skipped_and_read_once_it_is_whole(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"kind": "train", "step": 1, "loss": 2.0, "time": 1.0}) + "\n" + '{"kind": "tr')
    assert read_jsonl(path) == [{"kind": "train", "step": 1, "loss": 2.0, "time": 1.0}]
    tail = JsonlTail(path, goodput_fields)
    assert tail.read() == [{"kind": "train", "step": 1, "time": 1.0}]  # loss is not a goodput field
    with path.open("a") as f:
        f.write('ain", "step": 2, "time": 2.0}\n')
    assert [r["step"] for r in tail.read()] == [1, 2] and tail.offset == path.stat().st_size
    assert tail.read() == tail.records and len(tail.records) == 2  # nothing new: nothing parsed again
    assert read_jsonl(tmp_path / "missing.jsonl") == [] and JsonlTail(tmp_path / "missing.jsonl").read() == []


def test_a_new_writer_after_a_torn_last_line_keeps_its_first_record(tmp_path):
    # an attempt killed mid-write leaves an unterminated line; appended to it, the next attempt's `setup` record
    # was lost with it, merging two attempts in goodput
    from rich.console import Console

    from shardline.jsonl import read_jsonl
    from shardline.training.metrics import MetricsWriter

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "event", "event": "setup"}\n{"kind": "train", "step": 7, "lo')
    MetricsWriter(path, Console(quiet=True)).write("event", {"event": "setup", "attempt": 2})
    records = read_jsonl(path)
    assert [r.get("event") for r in records] == ["setup", "setup"] and records[1]["attempt"] == 2
    MetricsWriter(path, Console(quiet=True)).write("event", {"event": "resume"})  # a clean file stays clean
    assert path.read_text().count("\n\n") == 0 and len(read_jsonl(path)) == 3


def test_the_summary_says_a_rising_loss_rose():
    """A continued run can end above its first step's loss: "61% higher", not "-61% lower"."""
    from shardline.training.metrics import loss_trend

    assert loss_trend(7.705, 0.022) == "loss 7.705 → 0.022 (100% lower)"
    assert loss_trend(0.013, 0.021) == "loss 0.013 → 0.021 (62% higher)"
