"""Dry runs of several specs in one child process (one torch import for all; the fake process group is set up and
torn down per case): `python -m tests.train.dry_run_cases` reads cases as JSON on stdin, writes one result per case.

A case: {"preset", "world" (or null), "values" (dotted fields set after the world), "layers" (or null: a local
config.json of the preset's hub model with this many layers, read by planner and simulation alike), "step"}.
Or {"fake_group": true}: what torch's fake process group answers to `all_to_all_single` (the pytest process may
already hold a process group, which the fake one cannot join).
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from shardline.api import planning_device
from shardline.errors import ShardlineError
from shardline.planning.memory import model_shape, shape_config
from shardline.planning.simulation.dry_run import at_world, dry_run
from shardline.planning.simulation.fake_world import fake_process_group
from shardline.spec.resolve import load_spec, resolve_data


def with_layers(spec, layers: int, directory: Path):
    """The same spec over a local copy of its hub model's config with `layers` decoder blocks."""
    s = model_shape(spec.model)
    shape_config(replace(s, layers=layers, windows=s.windows[:layers])).save_pretrained(directory)
    return resolve_data(spec.model_dump(mode="json"), values={"model.path": str(directory)})


def fake_group_all_to_all() -> dict:
    """What torch's fake process group (rank 3 of 8) answers to `all_to_all_single` of 0..15."""
    with fake_process_group(8, 3):
        counts, received = torch.arange(16), torch.full((16,), -1)
        dist.all_to_all_single(received, counts)
    return {"received": received.tolist()}


def run(case: dict, tmp: Path) -> dict:
    if case.get("fake_group"):
        return fake_group_all_to_all()
    spec = at_world(load_spec(case["preset"]), case.get("world"))
    if case.get("values"):
        spec = resolve_data(spec.model_dump(mode="json"), values=case["values"])
    device = planning_device(spec)  # the hub model's GPU, before its path becomes a local directory
    if case.get("layers"):
        spec = with_layers(spec, case["layers"], tmp / f"{case['preset']}-{case['layers']}")
    try:
        return dry_run(spec, device, step=case["step"])
    except ShardlineError as e:
        return {"error": {"type": type(e).__name__, "where": e.where, "problem": e.problem, "fix": e.fix}}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        for case in json.load(sys.stdin):
            print(json.dumps(run(case, Path(tmp))), flush=True)
