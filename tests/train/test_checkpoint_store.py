"""Checkpoint storage: commit markers, retention, resume policy, and an s3:// round trip on moto."""

import contextlib
import errno
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch.distributed.tensor import DTensor

from shardline.checkpointing.manager import COMMITTED, COORDINATOR_CHECKSUMS, CheckpointStore, retained, step_name
from shardline.errors import SpecError
from shardline.spec.resume_policy import check_resume
from shardline.training.trainer import Trainer
from tests.conftest import free_port, small_spec


def _weights(model) -> torch.Tensor:
    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).flatten() for p in model.parameters()])


def _trainer(ctx, tmp, prepared, *overrides) -> Trainer:
    spec = small_spec(tmp, "train.precision=fp32", "train.peak_tflops=1", *overrides)
    return Trainer(spec, ctx, prepared, tmp / "run", Console(quiet=True))


def test_retention_keeps_last_k_and_every_mth():
    assert retained([2, 4, 6, 8, 10], keep_last=2, keep_every=4) == {4, 8, 10}
    assert retained([2, 4, 6], keep_last=5, keep_every=None) == {2, 4, 6}


def test_saves_commit_and_retention_deletes_only_after_a_newer_commit(ctx, tmp_path, prepared):
    t = _trainer(ctx, tmp_path, prepared, "checkpoint.keep_last=2", "checkpoint.async_save=true")
    store = t.checkpointer.store
    for _ in range(3):
        t.train_step()
        t.save_checkpoint()
        assert t.checkpointer.pending is not None  # async: training goes on while it writes
    t.checkpointer.wait()
    assert store.committed() == [2, 3]
    # a torn save (killed mid-write, disk full) newer than the last good one: never loaded, never a reason
    # to delete the good one
    torn = tmp_path / "run" / "checkpoints" / step_name(9)
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"partial")
    assert store.latest() == 3 and store.steps() == [2, 3, 9]
    fresh = _trainer(ctx, tmp_path, prepared)
    fresh.maybe_resume()
    assert fresh.step == 3 and torch.equal(_weights(fresh.model), _weights(t.model))
    assert (tmp_path / "run" / "checkpoints" / step_name(3) / "spec.yaml").exists()
    assert (tmp_path / "run" / "checkpoints" / step_name(3) / "tokenizer" / "tokenizer.json").exists()


def test_torn_checkpoints_older_than_a_commit_are_cleaned(ctx, tmp_path, prepared):
    t = _trainer(ctx, tmp_path, prepared, "checkpoint.async_save=false")
    (tmp_path / "run" / "checkpoints" / step_name(0)).mkdir(parents=True)
    t.train_step()
    t.save_checkpoint()
    assert t.checkpointer.store.steps() == [1]


def test_sync_save_blocks_until_committed_and_is_the_cpu_default(ctx, tmp_path, prepared):
    assert not _trainer(ctx, tmp_path, prepared).checkpointer.use_async
    t = _trainer(ctx, tmp_path, prepared, "checkpoint.async_save=false")
    t.train_step()
    t.save_checkpoint()
    assert t.checkpointer.pending is None and (tmp_path / "run" / "checkpoints" / step_name(1) / COMMITTED).exists()


def test_an_extended_run_takes_its_next_step_at_the_new_schedules_learning_rate(ctx, tmp_path, prepared):
    """max_steps 4 → 8 (checkpoint.allow_spec_change): the optimizer's saved lr is the old schedule's; the first
    step after the resume must be at the new schedule's, and so must the ones after it."""
    from shardline.training.optim import lr_factor

    short = ("checkpoint.async_save=false", "train.warmup_steps=1", "train.lr=1e-3")
    t = _trainer(ctx, tmp_path, prepared, "train.max_steps=4", *short)
    t.train_step()
    t.train_step()
    t.save_checkpoint()
    longer = _trainer(ctx, tmp_path, prepared, "train.max_steps=8", "checkpoint.allow_spec_change=true", *short)
    longer.load_checkpoint(2)
    new = longer.spec.train
    assert lr_factor(2, new) != lr_factor(2, t.spec.train)  # the schedules differ at the step resumed
    records = [longer.train_step() for _ in range(2)]
    assert [r.lr for r in records] == pytest.approx([1e-3 * lr_factor(k, new) for k in (2, 3)], rel=1e-12)


def test_resume_policy_separates_safe_flaggable_and_breaking_changes(tmp_path):
    base = small_spec(tmp_path)
    assert check_resume(base, small_spec(tmp_path, "parallel.nproc_per_node=2")) == []
    with pytest.raises(SpecError, match="allow_spec_change=true") as e:
        check_resume(base, small_spec(tmp_path, "train.lr=1e-4"))
    assert e.value.where == "train.lr"
    assert check_resume(base, small_spec(tmp_path, "train.lr=1e-4", "checkpoint.allow_spec_change=true"))
    with pytest.raises(SpecError, match="start a new run") as e:
        check_resume(base, small_spec(tmp_path, "train.seq_len=128", "checkpoint.allow_spec_change=true"))
    assert e.value.where == "train.seq_len"
    with pytest.raises(SpecError):
        check_resume(base, small_spec(tmp_path, "model.arch.hidden_size=128"))


@pytest.mark.parametrize("change", ["observe.metrics_port=9999", "cost.usd_per_device_hour=2.5", "run.name=other",
                                    "run.dir=/elsewhere", "data.cache_dir=/cache", "model.local_cache=/ssd"])
def test_resume_survives_changes_that_cannot_touch_the_model(tmp_path, change):
    """A preempted run whose metrics port is now taken, or that moved to another directory, still resumes."""
    assert check_resume(small_spec(tmp_path), small_spec(tmp_path, change)) == []  # refused (SpecError) before


def test_checkpoint_refuses_a_changed_model_on_resume(ctx, tmp_path, prepared):
    """A model of another shape is refused by the resume policy, naming the field, before DCP is asked to load
    weights that do not fit (its shape error names no setting)."""
    t = _trainer(ctx, tmp_path, prepared, "checkpoint.async_save=false")
    t.train_step()
    t.save_checkpoint()
    wider = _trainer(ctx, tmp_path, prepared, "model.arch.hidden_size=96", "model.arch.intermediate_size=256",
                     "checkpoint.allow_spec_change=true")  # the flag never lets a model change through
    with pytest.raises(SpecError, match="start a new run") as refused:
        wider.maybe_resume()
    assert refused.value.where == "model.arch.hidden_size", refused.value
    assert "model.arch.intermediate_size" in str(refused.value)
    assert wider.step == 0


def test_resume_refuses_a_changed_data_order_seed(tmp_path):
    """train.seed orders the data: a resumed run with another seed would see other rows (the policy's `never`)."""
    with pytest.raises(SpecError, match="start a new run") as refused:
        check_resume(small_spec(tmp_path), small_spec(tmp_path, "train.seed=7", "checkpoint.allow_spec_change=true"))
    assert refused.value.where == "train.seed"


@pytest.fixture
def s3_server(monkeypatch):
    moto = shutil.which("moto_server", path=os.path.dirname(sys.executable))
    if moto is None:
        pytest.fail("moto_server is missing: run ./scripts/setup (it installs the test extras)")
    port = free_port()
    proc = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(k, v)
    import boto3

    deadline = time.monotonic() + 20
    while True:
        try:
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="ckpt")
            break
        except Exception:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.2)
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)


def test_s3_round_trip_on_a_real_s3_server(ctx, tmp_path, prepared, s3_server):
    t = _trainer(ctx, tmp_path, prepared, "checkpoint.dir=s3://ckpt/runs", "run.id=a", "checkpoint.keep_last=1")
    for _ in range(2):
        t.train_step()
        t.save_checkpoint()
    t.checkpointer.wait()
    store = CheckpointStore("s3://ckpt/runs/a")
    assert store.remote and store.committed() == [2] and store.steps() == [2]
    assert store.verify(2) == [] and COORDINATOR_CHECKSUMS in store.files(2)
    fresh = _trainer(ctx, tmp_path, prepared, "checkpoint.dir=s3://ckpt/runs", "run.id=a")
    fresh.maybe_resume()
    assert fresh.step == 2 and torch.equal(_weights(fresh.model), _weights(t.model))
    assert fresh.train_step().loss == pytest.approx(t.train_step().loss, rel=1e-6)


def test_lora_checkpoint_holds_adapters_only_and_resumes(ctx, tmp_path, prepared):
    lora = ("model.lora.enabled=true", "model.lora.r=4", "checkpoint.async_save=false")
    t = _trainer(ctx, tmp_path, prepared, *lora)
    t.train_step()
    t.save_checkpoint()
    fresh = _trainer(ctx, tmp_path, prepared, *lora)
    fresh.maybe_resume()
    assert fresh.step == 1 and torch.equal(_weights(fresh.model), _weights(t.model))
    assert fresh.train_step().loss == pytest.approx(t.train_step().loss, rel=1e-6)


def _agree_on_two_ranks(rank: int, port: int, tmp: Path) -> None:
    """One rank of a 2-process gloo group: `Trainer._agree` where the ranks' own answers differ — rank 0's last
    save is a minute old, rank 1's is now; then a stop signal reaches rank 1 only."""
    import json
    from types import SimpleNamespace

    import torch.distributed as dist

    from shardline.resilience.signals import StopRequest

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        def agree(*overrides: str, signalled: bool, last_save: float) -> tuple[bool, bool]:
            me = SimpleNamespace(spec=small_spec(tmp, *overrides), stop=StopRequest(),
                                 ctx=SimpleNamespace(device=torch.device("cpu")))
            me.stop.signum = 10 if signalled else None  # as if SIGUSR1 had arrived here
            return Trainer._agree(me, last_save=last_save)

        now = time.monotonic()
        answers = {
            "due_on_rank_0_only": agree("checkpoint.every_minutes=0.5", signalled=False,
                                        last_save=now - 60.0 if rank == 0 else now),
            "no_every_minutes": agree(signalled=False, last_save=now - 60.0),
            "signal_on_rank_1_only": agree("checkpoint.every_minutes=0.5", signalled=rank == 1, last_save=now),
        }
        (tmp / f"rank-{rank}.json").write_text(json.dumps(answers))
    finally:
        dist.destroy_process_group()


def test_every_minutes_makes_all_ranks_agree_to_save(tmp_path):
    """Ranks whose clocks disagree about whether a save is due all save (one rank alone would hang in DCP's
    collectives), and a signal that reached one rank stops all of them."""
    import json

    import torch.multiprocessing as mp

    mp.spawn(_agree_on_two_ranks, args=(free_port(), tmp_path), nprocs=2)
    answers = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    for rank, got in enumerate(answers):
        assert got == {"due_on_rank_0_only": [False, True], "no_every_minutes": [False, False],
                       "signal_on_rank_1_only": [True, False]}, (rank, got)



def test_a_failed_write_on_a_full_filesystem_is_reported_as_no_space_whatever_torch_says(tmp_path):
    from torch.distributed.checkpoint.planner import SavePlan

    from shardline.checkpointing.storage import ChecksummedFileSystemWriter, out_of_space

    class ShortWrite(ChecksummedFileSystemWriter):  # what torch's zip writer raises when a write comes up short
        def _write_data(self, planner, file_queue):
            if fill:
                with contextlib.suppress(OSError):  # the disk fills up
                    (Path(self.path) / "filler").write_bytes(b"x" * (8 << 20))
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    mount = tmp_path / "fs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], check=True)
    try:
        writer = ShortWrite(str(mount))
        writer.set_up_storage_writer(True)
        plan = writer.prepare_global_plan([writer.prepare_local_plan(SavePlan([]))])[0]
        fill = False
        with pytest.raises(RuntimeError, match="unexpected pos"):  # room left: the error is what it was
            writer.write_data(plan, None)
        assert not out_of_space(str(mount))
        fill = True
        with pytest.raises(OSError) as raised:
            writer.write_data(plan, None)
        assert out_of_space(str(mount)) and raised.value.errno == errno.ENOSPC
        assert "No space left on device" in str(raised.value) and "unexpected pos" in str(raised.value)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)
