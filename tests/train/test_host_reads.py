"""The host reads of device data in a training step, held to a named budget (`tests/host_reads.py` finds them on
the CPU; on a GPU each is a point where the host waits for the device and stops queueing work ahead)."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from rich.console import Console

from shardline.data.loader import Batch
from shardline.training.trainer import Trainer
from tests.conftest import small_spec
from tests.host_reads import HostReads
from tests.tiers import needs_gpu

HOST_READS_PER_STEP = Counter({  # the trainer, once per step, after its last all-reduce: one copy to the host of
    ("_to_copy", "training/trainer.py"): 1,  # the loss sum, the ranks' times, the token and work counts, the norm
})  # and nothing per micro-batch: transformers' mask (a packed-sequence check that reads position_ids) is not built
STRAGGLER_SYNCS_PER_STEP = 2
"""On a GPU the step also waits for the device twice, on purpose, to time itself apart from its peers
(`resilience.stragglers`): after the counts' all-reduce (the wait for slower peers) and before its own time is
taken. Both are `torch.cuda.synchronize`, which the CPU count cannot see."""


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


@needs_gpu("torch's synchronisation debug mode is CUDA's (the CPU test above finds the same points)")
def test_on_a_gpu_a_whole_training_step_synchronises_only_where_the_cpu_count_says(ctx, session_dir, prepared):
    """The same step on CUDA under `torch.cuda.set_sync_debug_mode("warn")`: every operation that makes the host
    wait for the device (`.item()`, a device-to-host copy, a data-dependent shape, a stream synchronisation)
    warns: the step's count is the CPU test's budget plus the straggler timing's two deliberate waits."""
    spec = small_spec(session_dir, "train.peak_tflops=1")
    trainer = Trainer(spec, ctx, prepared, session_dir / "runs" / "cuda-syncs", Console(quiet=True))
    assert ctx.device.type == "cuda"
    trainer.train_step()  # the first step builds the optimizer state
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = Counter(f"{w.filename.rsplit('/src/', 1)[-1]}:{w.lineno}" for w in caught
                    if "synchronizing CUDA operation" in str(w.message))
    assert trainer.sampler.accum == 2
    assert sum(syncs.values()) == sum(HOST_READS_PER_STEP.values()) + STRAGGLER_SYNCS_PER_STEP, "\n".join(
        f"{n} × at {where}" for where, n in syncs.most_common())
