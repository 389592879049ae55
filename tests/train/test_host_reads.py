"""The host reads of device data in a training step, held to a named budget (`tests/host_reads.py` finds them on
the CPU; on a GPU each is a point where the host waits for the device and stops queueing work ahead)."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from rich.console import Console
from torch.utils._pytree import tree_leaves

from shardline.data.loader import Batch
from shardline.model.build import causal_lm
from shardline.training.trainer import Trainer
from tests.conftest import small_spec
from tests.host_reads import HostReads
from tests.tiers import needs_gpu

HOST_READS_PER_STEP = Counter({  # the trainer, once per step, after its last all-reduce: one copy to the host of
    ("_to_copy", "training/trainer.py"): 1,  # the loss sum, the ranks' times, the token and work counts, the norm
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

    host_offsets: set[int] = set()  # the batches' span offsets, which stay on the host
    passed: list[torch.Tensor] = []  # every tensor the model's root forward takes, as FSDP's root walks them

    def moved(batch: Batch, device) -> Batch:
        on_device = to_device(batch, device)
        reads.mark(on_device.input_ids, on_device.labels, on_device.position_ids)
        host_offsets.add(id(on_device.spans.cu_seqlens))
        return on_device

    def root_arguments(module, args, kwargs):
        passed.extend(leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor))

    monkeypatch.setattr(Batch, "to", moved)
    hooks = [m.register_forward_pre_hook(root_arguments, with_kwargs=True)  # a LoRA model's wrapper, or not
             for m in {trainer.model, causal_lm(trainer.model)}]
    with reads:
        trainer.train_step()
    for hook in hooks:
        hook.remove()
    assert trainer.sampler.accum == 2
    # FSDP's root module copies every tensor argument to the device: host offsets among them would be a copy that
    # waits for the device on every forward (a GPU's sync debug mode found 4 in this step), and a read back per layer
    assert passed and not [t for t in passed if id(t) in host_offsets]
    assert _by_file(reads.sites) == HOST_READS_PER_STEP, "\n".join(f"{n} × {op} at {where}" for (op, where), n in
                                                                  reads.sites.most_common())


@needs_gpu("torch's synchronisation debug mode is CUDA's (the CPU test above finds the same points)")
def test_on_a_gpu_a_whole_training_step_synchronises_only_where_the_cpu_count_says(ctx, session_dir, prepared):
    """The same step on CUDA under `torch.cuda.set_sync_debug_mode("warn")`: every operation that makes the host
    wait for the device (`.item()`, a copy between host and device of pageable memory, a data-dependent shape)
    warns, so the step's count is the CPU test's budget. The straggler timing's two deliberate
    `torch.cuda.synchronize` calls (`resilience.stragglers`) are not flagged by the debug mode (H200, torch 2.11).
    Found here on a GPU first: FSDP's root moving the span offsets to the device (4 syncs in a 2-micro-batch step)
    and the straggler slot written from a Python float (1)."""
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
    assert sum(syncs.values()) == sum(HOST_READS_PER_STEP.values()), "\n".join(
        f"{n} × at {where}" for where, n in syncs.most_common())
