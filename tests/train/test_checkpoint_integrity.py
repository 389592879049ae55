"""Checkpoints carry checksums and no code: damage is detected and skipped; a planted pickle never runs."""

import hashlib
import os
import pickle
import random
import shutil
import subprocess

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from rich.console import Console

from shardline.checkpointing.manager import CheckpointStore, step_name
from shardline.checkpointing.state import rng_state, set_rng_state
from shardline.errors import ShardlineError
from shardline.training.trainer import Trainer
from tests.conftest import small_spec


def _trainer(ctx, tmp, prepared, *overrides) -> Trainer:
    spec = small_spec(tmp, "train.precision=fp32", "train.peak_tflops=1", "checkpoint.async_save=false", *overrides)
    return Trainer(spec, ctx, prepared, tmp / "run", Console(quiet=True))


def _events(trainer: Trainer, kind: str) -> list[dict]:
    import json

    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == kind]


def test_every_checkpoint_file_is_listed_in_sha256sum_format(ctx, tmp_path, prepared):
    t = _trainer(ctx, tmp_path, prepared)
    t.train_step()
    t.save_checkpoint()
    step_dir = tmp_path / "run" / "checkpoints" / step_name(1)
    lists = sorted(p.name for p in step_dir.glob("*.sha256"))
    assert lists == ["__0_.sha256", "commit.sha256"]
    # coreutils' own sha256sum is the oracle: every file verifies, and every file but the lists is covered
    out = subprocess.run(["sha256sum", "-c", *lists], cwd=step_dir, capture_output=True, text=True, check=True)
    checked = {line.split(":")[0] for line in out.stdout.splitlines()}
    on_disk = {str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file()}
    assert checked == on_disk - {"COMMITTED", *lists}
    assert CheckpointStore(str(step_dir.parent)).verify(1) == []


@pytest.mark.parametrize("damage", ["flip_shard_byte", "truncate_metadata", "delete_shard_list", "garble_commit_list",
                                    "delete_commit_list"])
def test_damaged_checkpoint_is_skipped_for_the_newest_intact_one_with_a_warning(ctx, tmp_path, prepared, damage):
    t = _trainer(ctx, tmp_path, prepared, "checkpoint.keep_last=2")
    t.train_step()
    t.save_checkpoint()
    t.train_step()
    t.save_checkpoint()
    step_dir = tmp_path / "run" / "checkpoints" / step_name(2)
    if damage == "flip_shard_byte":
        shard = step_dir / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    elif damage == "truncate_metadata":
        meta = step_dir / ".metadata"
        meta.write_bytes(meta.read_bytes()[:-10])
    elif damage == "garble_commit_list":  # was: exit 2 instead of the fallback
        (step_dir / "commit.sha256").write_text("not a checksum list\n")
    elif damage == "delete_commit_list":  # was: verification silently off, the damaged step resumed
        (step_dir / "commit.sha256").unlink()
    else:
        (step_dir / "__0_.sha256").unlink()
    fresh = _trainer(ctx, tmp_path, prepared, "checkpoint.keep_last=2")
    fresh.maybe_resume()
    assert fresh.step == 1  # before: loaded the damaged step 2 (or crashed inside DCP)
    [warning] = _events(fresh, "checkpoint_damaged")
    assert step_name(2) in warning["message"]


class _Planted:
    """What an attacker with write access to the bucket would put in a checkpoint."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_a_planted_pickle_in_metadata_is_refused_and_never_runs(ctx, tmp_path, prepared):
    t = _trainer(ctx, tmp_path, prepared)
    t.train_step()
    t.save_checkpoint()
    marker = tmp_path / "owned"
    meta = tmp_path / "run" / "checkpoints" / step_name(1) / ".metadata"
    meta.write_bytes(pickle.dumps(_Planted(str(marker))))
    with pytest.raises(ShardlineError, match="not a DCP checkpoint index"):
        t.checkpointer.load(1, {"model": {}})
    assert not marker.exists()


def _pickle_calling(module: str, name: str, *args: str) -> bytes:
    """A protocol-4 pickle that names `module`/`name` (STACK_GLOBAL) and calls it with `args` (REDUCE): what
    `pickle.dumps` never writes for a dotted name, written by hand as an attacker would."""

    def text(value: str) -> bytes:
        data = value.encode()
        return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data

    call = pickle.MARK + b"".join(map(text, args)) + pickle.TUPLE + pickle.REDUCE if args else b""
    return pickle.PROTO + b"\x04" + text(module) + text(name) + pickle.STACK_GLOBAL + call + pickle.STOP


def _saved_metadata(tmp_path):
    """A real one-process DCP save; returns the store and its `.metadata` path."""
    store = CheckpointStore(str(tmp_path / "ckpt"))
    dcp.save({"w": torch.ones(2, 3), "train": {"step": 3}}, storage_writer=store.writer(1))
    return store, tmp_path / "ckpt" / step_name(1) / ".metadata"


@pytest.mark.parametrize("payload", ["dotted_global", "module_global", "reduce_allowed_callable",
                                     "build_on_a_type", "not_metadata"])
def test_a_hostile_metadata_is_a_named_error_and_runs_nothing(tmp_path, payload):
    store, meta = _saved_metadata(tmp_path)
    marker = tmp_path / "owned"
    payloads = {
        # was: passed the module-wide allowlist, resolved to os.system through attributes and ran the command
        "dotted_global": _pickle_calling("torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}"),
        "module_global": _pickle_calling("os", "system", f"touch {marker}"),
        # an allowlisted callable with arguments it was never meant to get: refused, not a KeyError traceback
        "reduce_allowed_callable": _pickle_calling("torch.serialization", "_get_layout", "no-such-layout"),
        # BUILD with slot state on a class sets class attributes for the whole process
        "build_on_a_type": (pickle.PROTO + b"\x04" + _pickle_calling("pathlib", "PosixPath")[2:-1]
                            + pickle.MARK + pickle.NONE + pickle.EMPTY_DICT + pickle.SHORT_BINUNICODE + b"\x05owned"
                            + pickle.NEWTRUE + pickle.SETITEM + pickle.TUPLE + pickle.BUILD + pickle.STOP),
        "not_metadata": pickle.dumps({"state_dict_metadata": {}}),
    }
    meta.write_bytes(payloads[payload])
    with pytest.raises(ShardlineError, match="is not a DCP checkpoint index") as e:
        store.reader(1).read_metadata()
    assert e.value.field == str(meta) and "resume from another checkpoint" in e.value.fix
    assert not marker.exists()
    import pathlib

    assert not hasattr(pathlib.PosixPath, "owned")


def test_a_real_metadata_still_reads_through_the_allowlist(tmp_path):
    store, meta = _saved_metadata(tmp_path)
    ours = store.reader(1).read_metadata()
    theirs = dcp.FileSystemReader(str(meta.parent)).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data


def test_export_of_a_checkpoint_with_a_rewritten_metadata_and_checksums_is_a_named_error(ctx, tmp_path, prepared):
    """Whoever can write the bucket can rewrite `commit.sha256` too: the unpickler is what stops them."""
    from shardline.export import export_run
    from shardline.rundir import create_run

    spec, run_dir = create_run(small_spec(tmp_path, "train.precision=fp32", "checkpoint.async_save=false",
                                          "run.id=hostile"))
    trainer = Trainer(spec, ctx, prepared, run_dir, Console(quiet=True))
    trainer.train_step()
    trainer.save_checkpoint()
    step_dir = run_dir / "checkpoints" / step_name(1)
    marker = tmp_path / "owned"
    (step_dir / ".metadata").write_bytes(
        _pickle_calling("torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}"))
    digest = hashlib.sha256((step_dir / ".metadata").read_bytes()).hexdigest()
    for path in step_dir.glob("*.sha256"):  # the attacker's own checksums: verification passes
        lines = path.read_text().splitlines()
        path.write_text("".join(f"{digest}  .metadata\n" if line.endswith("  .metadata") else f"{line}\n"
                                for line in lines))
    assert trainer.checkpointer.store.verify(1) == []
    with pytest.raises(ShardlineError, match="is not a DCP checkpoint index"):
        export_run(run_dir, tmp_path / "hf")  # was: ran the command, then AttributeError 'int' ... storage_meta
    assert not marker.exists()


def test_a_planted_pickle_in_a_checkpoint_value_is_refused_and_never_runs(ctx, tmp_path):
    marker = tmp_path / "owned"
    store = CheckpointStore(str(tmp_path / "ckpt"))
    dcp.save({"train": {"step": _Planted(str(marker))}}, storage_writer=store.writer(1))
    assert not marker.exists()
    from shardline.checkpointing.manager import Checkpointer
    from shardline.spec import CheckpointSpec

    checkpointer = Checkpointer(CheckpointSpec(async_save=False), str(tmp_path / "ckpt"), on_gpu=False)
    with pytest.raises(ShardlineError, match="non-data object"):
        checkpointer.load(1, {"train": {"step": 0}})  # before: torch.load(weights_only=False) ran it
    assert not marker.exists()


def test_rng_streams_are_tensors_and_round_trip_exactly():
    random.gauss(0, 1)  # leaves a cached Gaussian in both Python and NumPy streams
    np.random.standard_normal()
    saved = {k: v.clone() for k, v in rng_state().items()}
    assert all(isinstance(v, torch.Tensor) for v in saved.values())
    expected = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.standard_normal(),
                torch.rand(3))
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    set_rng_state(saved)
    got = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.standard_normal(), torch.rand(3))
    assert got[:4] == expected[:4] and torch.equal(got[4], expected[4])


def test_checkpoint_holds_no_pickled_objects_for_rng(ctx, tmp_path, prepared):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    t = _trainer(ctx, tmp_path, prepared)
    t.train_step()
    t.save_checkpoint()
    meta = t.checkpointer.store.reader(1).read_metadata().state_dict_metadata
    rng = {k: v for k, v in meta.items() if k.startswith("rng_rank0.")}
    assert rng and all(isinstance(v, TensorStorageMetadata) for v in rng.values())
    shutil.rmtree(tmp_path / "run")


def test_a_checkpoint_without_its_spec_or_with_a_bad_one_is_a_named_error(ctx, tmp_path, prepared):
    t = _trainer(ctx, tmp_path, prepared)
    t.train_step()
    t.save_checkpoint()
    spec_file = tmp_path / "run" / "checkpoints" / step_name(1) / "spec.yaml"
    text = spec_file.read_text()
    spec_file.write_text(text.replace("train:", "train:\n  no_such_knob: 1", 1))
    with pytest.raises(ShardlineError) as bad:
        t.load_checkpoint(1)
    assert bad.value.field == "train.no_such_knob" and str(spec_file) in bad.value.problem
    spec_file.unlink()
    with pytest.raises(ShardlineError) as missing:
        t.load_checkpoint(1)
    assert missing.value.field == str(spec_file) and "cannot be checked" in missing.value.problem
