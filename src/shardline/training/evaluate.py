"""Evaluation on the sharded model: validation loss, greedy generation scored by the task's metric, and sample
generations beside their references where no metric scores them.

Every rank runs the same number of forward passes (FSDP all-gathers in lockstep): validation batches
are padded to equal counts, and generation uses `synced_gpus` so ranks that finish early keep
stepping until all are done. Because of that lockstep, every rank calls `after_batch` after the same batches: the
trainer's place to let the ranks agree to stop (it raises to abandon the evaluation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import PreTrainedTokenizerBase, StoppingCriteria, StoppingCriteriaList

from shardline.data.loader import IGNORE_INDEX, Batch
from shardline.data.render import generation_prompt
from shardline.data.template import encode_prompt, stop_ids
from shardline.example import Example
from shardline.model import moe
from shardline.model.build import causal_lm
from shardline.model.document_attention import (
    DENSE_MASKS,
    HOST_OFFSETS,
    NAME,
    WHOLE_ROWS,
    HostOffsets,
    dense_masks,
    mask_placeholder,
    uses_dense_mask,
    whole_rows,
)
from shardline.model.families import is_tested, layer_windows
from shardline.parallel.context import context_parallel_batch, shard_batch
from shardline.parallel.fsdp import data_parallel_rank
from shardline.parallel.tensor import loss_context
from shardline.spec import JobSpec
from shardline.tasks import GenerationScores, Task
from shardline.training.chunked_loss import chunked_loss
from shardline.training.generation import generate_left_padded


def takes_chunked_loss(config, chunk_tokens: int | None) -> bool:
    """Whether `token_loss_sum` computes the loss in chunks (`shardline.training.chunked_loss`): `chunk_tokens` set
    (`train.loss_chunk_tokens` > 0) and a family of `shardline.model.families`, whose causal LM head is known (a
    linear map, Gemma 2's final-logit cap). Any other family's forward may do more to its logits (Granite scales
    them), so its loss comes from its whole `.logits`: the trainer says so at setup."""
    return bool(chunk_tokens) and is_tested(config)


def token_loss_sum(model: nn.Module, batch: Batch, chunk_tokens: int | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy over loss-bearing positions, in fp32.

    `chunk_tokens` (`train.loss_chunk_tokens`): the LM head and the loss over chunks of that many loss-bearing
    tokens (`shardline.training.chunked_loss`); None or 0: over the model's whole `.logits`, as transformers
    computes them, also for a family outside `shardline.model.families` (its head may do more than a linear
    map and Gemma 2's cap: `takes_chunked_loss`). The batch's document spans go to the model as varlen keywords:
    document-masked attention reads them (`flash_attention_2`, shardline's per-document SDPA); `eager` ignores them
    and masks from the positions.

    A mixture of experts with its router auxiliary loss on (`shardline.model.moe`) adds, while gradients are on,
    coef · aux · `batch.n_loss_tokens` (aux over this batch's real tokens): the step's loss is then transformers'
    `cross-entropy + coef · aux`."""
    lm = causal_lm(model)
    coefficient = moe.aux_loss_coefficient(lm.config) if torch.is_grad_enabled() else 0.0
    with moe.router_logits(lm, record=coefficient > 0) as routed:
        loss = _token_loss(model, batch, chunk_tokens, "sum")
    if coefficient:
        loss = loss + moe.aux_loss_term(lm, routed, batch.spans, batch.input_ids.shape, batch.n_loss_tokens)
    return loss


def token_losses(model: nn.Module, batch: Batch, chunk_tokens: int | None = None,
                 temperature: float = 1.0) -> torch.Tensor:
    """`token_loss_sum`'s terms: the fp32 cross-entropy of each loss-bearing position of `batch`, in flattened
    order ([batch.n_loss_tokens]); minus each is the log-probability of that target (of the logits divided by
    `temperature`: GRPO's policy at its sampling temperature)."""
    return _token_loss(model, batch, chunk_tokens, "none", temperature)


def _token_loss(model: nn.Module, batch: Batch, chunk_tokens: int | None, reduction: str,
                temperature: float = 1.0) -> torch.Tensor:
    attention, device = getattr(model.config, "_attn_implementation", ""), batch.input_ids.device
    if batch.spans is None:
        spans = {}
    elif "flash" in attention:  # flash reads the varlen offsets on the device
        spans = batch.spans.model_kwargs(device)
    else:  # shardline's attention reads them on the host
        spans = {HOST_OFFSETS: HostOffsets(batch.spans.cu_seqlens)}
    rows, seq = batch.input_ids.shape
    lm = causal_lm(model)
    if spans and attention == NAME:
        spans["attention_mask"] = mask_placeholder(rows, device)  # the attention reads spans: transformers builds none
        # Plain causal rows, or masks built before the forward (on whole rows only for layers with a shorter window):
        # the attention then reads no span offsets on the host, so a compiled block does not break
        whole = spans[WHOLE_ROWS] = whole_rows(batch.spans, rows)
        if uses_dense_mask(seq, device):
            windows = layer_windows(lm.config)
            needed = not whole or any(w and w < seq for w in windows)
            if needed and (masks := dense_masks(batch.spans, rows, seq, device, windows)) is not None:
                spans[DENSE_MASKS] = masks
    spans.update(moe.forward_kwargs(lm.config))  # a mixture of experts: no aux loss of transformers' own here
    if chunk_tokens and takes_chunked_loss(lm.config, chunk_tokens):  # (chunk_tokens: narrowed for the call)
        return chunked_loss(lm, batch.labels, batch.n_loss_tokens, chunk_tokens, reduction, temperature,
                            input_ids=batch.input_ids, position_ids=batch.position_ids, **spans)
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, **spans).logits.flatten(0, 1).float()
    labels = batch.labels.flatten()
    if temperature != 1.0:
        logits = logits / temperature
    losses = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction=reduction)
    return losses if reduction == "sum" else losses[labels != IGNORE_INDEX]


@contextlib.contextmanager
def rank_part(model: nn.Module, batch: Batch, cp_mesh: DeviceMesh | None) -> Iterator[Batch]:
    """The part of `batch` this rank computes the loss of, inside the contexts its forward and backward need:
    loss parallel (tensor parallel), this rank's tokens and their attention masks (context parallel)."""
    part, shard = shard_batch(batch, cp_mesh) if cp_mesh is not None else (batch, None)
    with loss_context(model), context_parallel_batch(shard) if shard is not None else contextlib.nullcontext():
        yield part


AfterBatch = Callable[[], None]
"""Called on every rank after each evaluation batch; raises to abandon the evaluation."""


def _nothing() -> None:
    return None


@torch.no_grad()
def validation_loss_sums(model: nn.Module, batches: list[Batch], device: torch.device,
                         chunk_tokens: int | None = None, cp_mesh: DeviceMesh | None = None,
                         after_batch: AfterBatch = _nothing) -> tuple[float, int]:
    """The summed loss and the loss-bearing tokens of `batches` over all ranks."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    try:
        for batch in batches:
            with rank_part(model, batch.to(device), cp_mesh) as part:
                total[0] += token_loss_sum(model, part, chunk_tokens).double()
            total[1] += part.n_loss_tokens
            after_batch()
    finally:
        model.train()
    dist.all_reduce(total)
    return float(total[0]), int(total[1])


def validation_loss(model: nn.Module, batches: list[Batch], device: torch.device,
                    chunk_tokens: int | None = None, cp_mesh: DeviceMesh | None = None,
                    after_batch: AfterBatch = _nothing) -> float:
    total, tokens = validation_loss_sums(model, batches, device, chunk_tokens, cp_mesh, after_batch)
    return total / max(tokens, 1)


def unique_questions(examples: list[Example]) -> list[Example]:
    """The first example of each (question, context): a repeated question must not count twice."""
    first: dict[tuple[str, str], Example] = {}
    for ex in examples:
        first.setdefault((ex.question, ex.context), ex)
    return list(first.values())


class _StopWhenRequested(StoppingCriteria):
    """Ends every sequence of a `generate` call once `requested()` (this rank's stop flag) is true. With
    `synced_gpus` a rank that ended keeps stepping with its peers until they end too, so stopping on one rank's
    own flag keeps the lockstep; the cut-short answers are never scored (`after_batch` raises on every rank)."""

    def __init__(self, requested: Callable[[], bool]) -> None:
        self.requested = requested

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.requested(), dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def _generate(model: nn.Module, prompts: list[list[int]], pad: int, stop: list[int], max_new_tokens: int,
              device: torch.device, synced: bool, stop_requested: Callable[[], bool] | None = None
              ) -> list[list[int]]:
    """Greedy continuations of left-padded prompts, each cut before its first stop token."""
    continuations = generate_left_padded(
        model, prompts, pad, device, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=stop,
        synced_gpus=synced,
        stopping_criteria=StoppingCriteriaList([_StopWhenRequested(stop_requested)] if stop_requested else []))
    return [c[: next((i for i, t in enumerate(c) if t in stop), len(c))] for c in continuations]


def generate_texts(model: nn.Module, tok: PreTrainedTokenizerBase, prompts: list[list[int]], stops: list[list[int]],
                   spec: JobSpec, pad: int, device: torch.device, batch_size: int = 16, ranks_per_row: int = 1,
                   after_batch: AfterBatch = _nothing, stop_requested: Callable[[], bool] | None = None
                   ) -> list[str] | None:
    """Greedy continuations of `prompts` (each cut at its own stop ids), split over the data-parallel ranks
    (`ranks_per_row` consecutive ranks, tensor- and context-parallel peers, generate the same prompts together;
    context-parallel peers each run whole prompts); rank 0 returns them all in order, other ranks None.

    `stop_requested` (this rank's stop flag) ends a batch's generation early; `after_batch` must then raise, as the
    trainer's does once any rank's flag is set."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank, dp_world = data_parallel_rank(rank, world, ranks_per_row)
    per_rank = -(-len(prompts) // dp_world)
    mine = list(range(dp_rank * per_rank, min(len(prompts), (dp_rank + 1) * per_rank)))
    n_batches = -(-per_rank // batch_size)
    model.eval()
    predictions: list[tuple[int, str]] = []
    try:
        for b in range(n_batches):
            index = mine[b * batch_size : (b + 1) * batch_size]
            todo = index or [0]  # a rank with no work still steps in lockstep
            stop = sorted({t for i in todo for t in stops[i]})
            outputs = _generate(model, [prompts[i] for i in todo], pad, stop, spec.train.eval_max_new_tokens, device,
                                world > 1, stop_requested)
            after_batch()
            if index:
                texts = [tok.decode(o, skip_special_tokens=True).strip() for o in outputs]
                predictions += list(zip(index, texts, strict=True))
    finally:
        model.train()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, predictions)
    if rank != 0:
        return None
    texts = dict(p for part in gathered for p in part)
    return [texts[i] for i in range(len(prompts))]


def generation_eval(model: nn.Module, tok: PreTrainedTokenizerBase, examples: list[Example], spec: JobSpec,
                    task: Task, pad: int, device: torch.device, batch_size: int = 16,
                    ranks_per_row: int = 1, after_batch: AfterBatch = _nothing,
                    stop_requested: Callable[[], bool] | None = None) -> GenerationScores | None:
    """Greedy-generate an answer for each distinct question of `examples` with the task's prompt (`generate_texts`);
    rank 0 returns the task's scores of them, other ranks None. The task must have a metric."""
    assert task.score is not None, f"task {task.name} has no generation metric"
    examples = unique_questions(examples)
    fmt = spec.data.prompt_format
    stop = stop_ids(tok, fmt)  # EOS, or the chat template's end of turn
    prompts = [encode_prompt(tok, task.prompt, ex.question, ex.context, fmt, ex.prompt) for ex in examples]
    texts = generate_texts(model, tok, prompts, [stop] * len(prompts), spec, pad, device, batch_size,
                           ranks_per_row, after_batch, stop_requested)
    if texts is None:
        return None
    return task.score(examples, texts, spec.data)


def sample_generations(model: nn.Module, tok: PreTrainedTokenizerBase, examples: list[Example], spec: JobSpec,
                       task: Task, pad: int, device: torch.device, ranks_per_row: int = 1,
                       after_batch: AfterBatch = _nothing, stop_requested: Callable[[], bool] | None = None
                       ) -> list[dict] | None:
    """Greedy answers to the examples that ask something (not raw text), beside their references: what a run on a
    user's own data shows in its report (rank 0; other ranks None)."""
    asked = [(ex, q) for ex in examples if (q := generation_prompt(tok, ex, task.prompt, spec.data.prompt_format))]
    if not asked:
        return []
    texts = generate_texts(model, tok, [q[0] for _, q in asked], [q[2] for _, q in asked], spec, pad, device,
                           ranks_per_row=ranks_per_row, after_batch=after_batch, stop_requested=stop_requested)
    if texts is None:
        return None
    return [{"question": tok.decode(q[0], skip_special_tokens=False)[-600:], "gold": q[1], "pred": text,
             "source": ex.source} for (ex, q), text in zip(asked, texts, strict=True)]
