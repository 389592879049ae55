"""One simulated training step of a sharded model on fake tensors: its per-rank memory peak, the phase where it
happens, and the FLOPs its kernels execute; for GRPO, its sampling's peak too.

The step is the trainer's: `token_loss_sum` (forward with the document spans, summed cross-entropy in fp32),
backward, gradient clipping, AdamW, zero_grad (FLOPs counted by FlopCounterMode, grouped matmuls by
`grouped_mm_flops`); on micro-batches of random tokens, one document per row (two
micro-batches when the spec accumulates gradients). A first step runs untracked: it creates AdamW's state (as
every later step finds it) and lets DTensor cache its shape propagation, which the tracker would otherwise count
as memory. CPU kernels run: shardline's per-document SDPA on the CPU flash kernel (FlopCounterMode counts no
FLOPs for it), CPU dropout (a noise tensor in the compute dtype where CUDA keeps a bool mask) and unfused
(foreach) AdamW. GRPO's sampling peaks at the last token `generate` decodes: a no-grad forward of one token per
sequence over a KV cache as long as the row (transformers' `DynamicCache`, as `generate` keeps it), every block's
weights gathered in turn, and the fp32 softmax of the last position's logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from transformers import DynamicCache

from shardline.data.loader import Batch
from shardline.data.spans import document_spans
from shardline.model import document_attention
from shardline.model.build import causal_lm
from shardline.model.families import layer_windows
from shardline.model.nf4 import nf4_stored_bytes, reallocate_nf4
from shardline.parallel.tensor import loss_context
from shardline.planning.simulation.fake_world import fake_tensor_mode, mem_tracker_class
from shardline.spec import TrainSpec
from shardline.training.loss import token_loss_sum
from shardline.training.optim import build_optimizer, clip_grad_norm

CPU = torch.device("cpu")


@dataclass(frozen=True)
class StepMemory:
    peak_bytes: int
    phase: str  # where the peak is: "forward", "backward (model.layers.3)", "optimizer step", …
    breakdown: dict[str, int]  # the tracker's categories at the peak (Sharded Param, Activation, OptState, …)
    flops: int  # counted by FlopCounterMode over the untracked step (CPU SDPA counts none)


def grouped_mm_flops(a_shape, b_shape, *_, out_shape=None, **__) -> int:
    """FLOPs of torch's grouped matmul (`aten._grouped_mm`: a mixture's experts, each on its own rows), for which
    FlopCounterMode has no formula: 2 per multiply-add. Forward and input gradient multiply rows [S, K] by every
    group's [K, N] into [S, N]; the weight gradient multiplies [K, S] by [S, N] into one [K, N] per group."""
    if len(out_shape) == 3 and len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(out_shape) * a_shape[-1]


def one_document_rows(spec: TrainSpec, vocab: int) -> Batch:
    """A micro-batch of random tokens, one document per row, every position carrying loss (real tensors: the
    spans are read on the host, as the trainer reads them)."""
    shape = (spec.micro_batch_size, spec.seq_len)
    tokens = torch.randint(0, vocab, shape)
    positions = torch.arange(spec.seq_len).expand(shape).contiguous()
    n = tokens.numel()
    return Batch(tokens, tokens.clone(), positions, n, n,
                 document_spans(positions, torch.full((spec.micro_batch_size,), spec.seq_len)))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, spec: TrainSpec, batches: list[Batch],
          mark: Callable[[str], None]) -> None:
    for i, batch in enumerate(batches):
        with loss_context(model):  # tensor parallel's loss over the vocabulary shards: forward and backward
            loss = token_loss_sum(model, batch, spec.loss_chunk_tokens) / batch.n_loss_tokens
            mark("forward and loss")
            loss.backward()
        mark("backward" if i == len(batches) - 1 else f"micro-batch {i + 1}")
    clip_grad_norm([p for p in model.parameters() if p.requires_grad], spec.max_grad_norm or float("inf"))
    mark("gradient clipping")
    optimizer.step()
    mark("optimizer step")
    optimizer.zero_grad(set_to_none=True)


def _total(snapshot: dict) -> int:
    return sum(s.get("Total", 0) for s in snapshot.values())


@dataclass(frozen=True)
class Sampling:
    """What GRPO's sampling holds on a rank: `sequences` sequences of `tokens` tokens, keys and values in `dtype`."""

    sequences: int
    tokens: int
    dtype: torch.dtype


def simulate_step(model: nn.Module, spec: TrainSpec, vocab: int, micro_batches: int,
                  progress: Callable[[str], None] = lambda _: None,
                  sampling: Sampling | None = None) -> tuple[StepMemory, StepMemory | None]:
    """Run the step twice on `model` (sharded on the meta device), its storage fake; then, given `sampling`, the
    last decoded token of GRPO's sampling."""
    batches = [one_document_rows(spec, vocab) for _ in range(micro_batches)]
    document_attention.prepare(batches[0].spans, CPU, layer_windows(causal_lm(model).config))
    with fake_tensor_mode():
        model.to_empty(device=CPU)
        reallocate_nf4(model, CPU)
        optimizer = build_optimizer(model, spec, CPU)
        step = _run(model, optimizer, spec, batches, progress)
        return step, None if sampling is None else _sample(model, optimizer, sampling, progress)


def _sample(model: nn.Module, optimizer: torch.optim.Optimizer, sampling: Sampling,
            progress: Callable[[str], None]) -> StepMemory:
    lm = causal_lm(model)
    config = lm.config
    n, kv_heads = sampling.sequences, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    progress(f"GRPO sampling: the last token of {n} sequences over a KV cache of {sampling.tokens} positions")
    tracker = mem_tracker_class()(lm, optimizer)  # AdamW's state stays resident while the rank samples
    with tracker, torch.no_grad():
        cache = DynamicCache(config=config)
        for layer in range(config.num_hidden_layers):  # the positions decoded before the last one
            keys = torch.zeros(n, kv_heads, sampling.tokens - 1, head_dim, dtype=sampling.dtype)
            cache.update(keys, torch.zeros_like(keys), layer)
        logits = lm(input_ids=torch.zeros(n, 1, dtype=torch.long), past_key_values=cache, use_cache=True,
                    attention_mask=torch.ones(n, sampling.tokens, dtype=torch.long), logits_to_keep=1,
                    position_ids=torch.full((n, 1), sampling.tokens - 1)).logits
        torch.softmax(logits[:, -1].float(), dim=-1)  # generate's sampling distribution
    snapshot = tracker.get_tracker_snapshot("peak")
    peak, breakdown = _with_nf4(model, _total(snapshot), _breakdown(snapshot))
    return StepMemory(peak, "GRPO sampling (last decoded token)", breakdown, 0)


def _run(model: nn.Module, optimizer: torch.optim.Optimizer, spec: TrainSpec, batches: list[Batch],
         progress: Callable[[str], None]) -> StepMemory:
    progress("warm-up step (untracked, FLOPs counted)")
    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten._grouped_mm: grouped_mm_flops}) as counter:
        _step(model, optimizer, spec, batches, lambda _: None)
    progress("tracked step")
    tracker = mem_tracker_class()(causal_lm(model), optimizer)  # the FSDP root, inside a peft wrapper
    tracker.track_inputs(tuple(b.input_ids for b in batches))
    reached: list[tuple[str, int]] = []

    def mark(stage: str) -> None:
        reached.append((stage, _total(tracker.get_tracker_snapshot("peak"))))
        progress(stage)
        if stage.startswith("micro-batch"):  # the tracker refuses a second forward of its modules otherwise
            tracker.reset_mod_stats()

    with tracker:
        _step(model, optimizer, spec, batches, mark)
    peak_snap = tracker.get_tracker_snapshot("peak")
    peak = _total(peak_snap)
    stage = next(name for name, value in reached if value >= peak)
    total, breakdown = _with_nf4(model, peak, _breakdown(peak_snap))
    return StepMemory(total, _where(tracker, stage, peak), breakdown, counter.get_total_flops())


def _with_nf4(model: nn.Module, peak: int, breakdown: dict[str, int]) -> tuple[int, dict[str, int]]:
    """The tracked peak and its parts with QLoRA's NF4 weights added: they are outside FSDP, allocated before the
    tracker starts, and resident throughout, so it never sees them."""
    if nf4 := nf4_stored_bytes(model):
        breakdown["NF4 Param"] = nf4
    return peak + nf4, breakdown


def _breakdown(snapshot: dict) -> dict[str, int]:
    parts: dict[str, int] = {}
    for per_device in snapshot.values():
        for kind, value in per_device.items():
            if kind != "Total" and value:
                parts[kind] = parts.get(kind, 0) + value
    return parts


def _where(tracker, stage: str, peak: int) -> str:
    """`stage`; in backward, the FSDP module whose own peak is the step's, else the loss's backward (cross-entropy
    and the logits' gradients, before any module's backward)."""
    if stage != "backward" and not stage.startswith("micro-batch"):
        return stage
    for stats in reversed(list(tracker.memory_tracking.values())):
        snaps = [s for key, value in stats.snapshots.items() if str(key.value) == "Peak-Backward" for s in value]
        if any(_total(s) >= peak for s in snaps):
            return f"backward of {stats.mod_fqn.partition('.')[2] or 'the root (output projection)'}"
    return "backward of the loss (cross-entropy, logits gradients)"
