"""bench/startup.py on the tiny preset: each part of a run's start-up timed, wall and CPU."""

from __future__ import annotations

import pytest

from tests.conftest import bench_module


def test_the_parts_of_start_up_are_timed_on_the_meta_device_and_from_one_blocks_draws(ctx):
    startup = bench_module("startup")
    laps = startup.in_process("tiny")
    assert list(laps)[:3] == ["process group (gloo, world 1)", "model on meta (+ LoRA)", "parallelize (FSDP2, meta)"]
    init = next(name for name in laps if name.startswith("random init of"))
    assert laps[init]["wall"] > 0 and all(s["cpu"] >= 0 for s in laps.values())


@pytest.mark.slow
def test_an_import_is_timed_in_a_fresh_interpreter():
    seconds = bench_module("startup").import_seconds("import json", repeat=1)
    assert 0 < seconds["wall"] < 30 and seconds["cpu"] > 0
