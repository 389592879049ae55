"""A model directory comes from outside: the entries of its `model.safetensors.index.json` must stay inside it."""

import json
import os
import shutil

import pytest

from shardline.errors import SpecError
from shardline.model.build import build_model
from shardline.spec import ModelSpec
from tests.model.test_sharded_load import _hf_checkpoint

INDEX = "model.safetensors.index.json"


def _pointing_first_shard_at(path, entry: str):
    """The sharded checkpoint at `path` with the first shard's keys mapped to `entry` in its index."""
    index = json.loads((path / INDEX).read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"] = {k: (entry if v == first else v) for k, v in index["weight_map"].items()}
    (path / INDEX).write_text(json.dumps(index))
    return first


def _outside(tmp_path, path, first):
    """The first shard moved out of the model directory, into a folder beside it."""
    other = tmp_path / "someone-elses"
    other.mkdir()
    shutil.move(path / first, other / first)
    return other / first


@pytest.mark.parametrize("how", ["dot-dot", "absolute", "symlink-out"])
def test_index_entries_that_leave_the_model_directory_are_refused_by_name(tmp_path, how):
    path = _hf_checkpoint(tmp_path / "ck", sharded=True)
    first = sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))[0]
    outside = _outside(tmp_path, path, first)
    if how == "dot-dot":
        entry = f"../someone-elses/{first}"
    elif how == "absolute":
        entry = str(outside)
    else:
        entry = first
        (path / first).symlink_to(outside)
    _pointing_first_shard_at(path, entry)
    with pytest.raises(SpecError) as err:
        build_model(ModelSpec(path=str(path)), 0, {})
    assert err.value.where == str(path / INDEX) and repr(entry) in err.value.problem
    assert "outside the model directory" in err.value.problem and "model directory" in err.value.fix


def test_a_hub_cache_snapshot_whose_files_link_to_its_blobs_still_loads(tmp_path):
    """Hugging Face's cache keeps `snapshots/<rev>/<file>` as links to `../../blobs/<hash>`: inside the cached repo."""
    saved = _hf_checkpoint(tmp_path / "ck", sharded=True)
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(saved.iterdir())):
        shutil.move(f, blobs / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / f.name)
    model = build_model(ModelSpec(path=str(snapshot)), 0, {})
    assert sum(p.numel() for p in model.parameters()) > 0
