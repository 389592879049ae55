"""Goodput's buckets from records and a manifest: they sum to the wall time, and time is put where it belongs."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from shardline.goodput import compute_goodput

DAY = 86_400.0
T0 = 1_790_000_000.0


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")


def _attempt_records(start: float, steps: range) -> list[dict]:
    setup = {"kind": "event", "event": "setup", "time": start + 20.0, "process_start": start + 5.0}
    return [setup, *({"kind": "train", "step": s, "time": start + 20.0 + 2.0 * i, "step_time_s": 2.0}
                     for i, s in enumerate(steps, 1))]


def test_a_launch_that_failed_in_setup_then_a_relaunch_a_day_later_is_restart_gap_not_startup():
    # launch 1 at T0 failed before its workers started (bad input); launch 2 a day later trained 10 steps
    records = _attempt_records(T0 + DAY, range(1, 11))
    end = records[-1]["time"]
    manifest = {"start_time": _iso(T0), "status": "finished", "end_time": _iso(end),
                "attempts": [{"start_time": _iso(T0), "prepare_s": 3.0},
                             {"start_time": _iso(T0 + DAY), "prepare_s": 4.0}]}
    g = compute_goodput(records, manifest)
    assert g.wall_s == pytest.approx(end - T0)  # the run's whole life, launch 1 included
    assert g.buckets["startup"] == pytest.approx(20.0 - 4.0)  # launch 2 → its first record, less its preparation
    assert g.buckets["data_preparation"] == pytest.approx(4.0)
    assert g.buckets["restart_gap"] == pytest.approx(DAY)  # was: 24 h of startup
    assert g.buckets["productive"] == pytest.approx(20.0)
    assert sum(g.buckets.values()) == pytest.approx(g.wall_s)


def test_one_launch_counts_its_lead_as_startup_and_preparation():
    records = _attempt_records(T0, range(1, 6))
    manifest = {"start_time": _iso(T0), "status": "finished", "end_time": _iso(records[-1]["time"]),
                "attempts": [{"start_time": _iso(T0), "prepare_s": 3.0}]}
    g = compute_goodput(records, manifest)
    assert g.buckets["restart_gap"] == 0.0 and g.buckets["data_preparation"] == pytest.approx(3.0)
    assert g.buckets["startup"] == pytest.approx(17.0) and g.wall_s == pytest.approx(30.0)
    assert sum(g.buckets.values()) == pytest.approx(g.wall_s)


def test_grpo_sampling_and_scoring_are_their_own_buckets_not_productive_time():
    records = _attempt_records(T0, range(1, 6))
    for r in records[1:]:
        r["data_wait_s"] = 0.1
        r["grpo"] = {"generation_s": 1.2, "reward_s": 0.3}
    manifest = {"start_time": _iso(T0), "status": "finished", "end_time": _iso(records[-1]["time"]),
                "attempts": [{"start_time": _iso(T0), "prepare_s": 3.0}]}
    g = compute_goodput(records, manifest)
    assert g.buckets["generation"] == pytest.approx(5 * 1.2) and g.buckets["scoring"] == pytest.approx(5 * 0.3)
    assert g.buckets["productive"] == pytest.approx(5 * (2.0 - 0.1 - 1.2 - 0.3))
    assert g.buckets["data_wait"] == pytest.approx(0.5)
    assert sum(g.buckets.values()) == pytest.approx(g.wall_s)
    assert "generation 20.0%" in g.line()  # 6 s of the run's 30 s
