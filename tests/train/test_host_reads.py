"""The host reads of device data in a training step, held to a named budget (`tests/host_reads.py` finds them on
the CPU; on a GPU each is a point where the host waits for the device and stops queueing work ahead)."""

from __future__ import annotations

from collections import Counter

import pytest
from rich.console import Console

from shardline.data.loader import Batch
from shardline.training.trainer import Trainer
from tests.conftest import small_spec
from tests.host_reads import HostReads

HOST_READS_PER_STEP = Counter({  # the trainer, once per step, after its one all-reduce: the first read waits for
    ("_local_scalar_dense", "training/trainer.py"): 4,  # the step; the loss, tokens, work counts, gradient norm
})  # and nothing per micro-batch: transformers' mask (a packed-sequence check that reads position_ids) is not built


def _by_file(sites: Counter) -> Counter:
    files: Counter = Counter()
    for (op, where), n in sites.items():
        files[op, where.rsplit(":", 1)[0]] += n
    return files


@pytest.mark.parametrize("overrides", [[], ["model.lora.enabled=true"], ["train.loss_chunk_tokens=64"]])
def test_a_training_step_reads_device_data_only_at_its_end(ctx, session_dir, prepared, monkeypatch, overrides):
    """Packed rows through per-document attention, two micro-batches: no layer, no mask, no loss chunk and no
    optimizer step reads device data on the host (the span indices are built on the host before the batch moves,
    and transformers' mask building is skipped: `document_attention.mask_placeholder`)."""
    spec = small_spec(session_dir, "train.peak_tflops=1", *overrides)
    trainer = Trainer(spec, ctx, prepared, session_dir / "runs" / "host-reads", Console(quiet=True))
    trainer.train_step()  # the first step builds the optimizer state
    reads = HostReads(trainer.model)
    to_device = Batch.to

    def moved(batch: Batch, device) -> Batch:
        on_device = to_device(batch, device)
        reads.mark(on_device.input_ids, on_device.labels, on_device.position_ids)
        return on_device

    monkeypatch.setattr(Batch, "to", moved)
    with reads:
        trainer.train_step()
    assert trainer.sampler.accum == 2
    assert _by_file(reads.sites) == HOST_READS_PER_STEP, "\n".join(f"{n} × {op} at {where}" for (op, where), n in
                                                                  reads.sites.most_common())
