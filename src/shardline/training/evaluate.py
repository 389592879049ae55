"""Evaluation on the sharded model: validation loss, greedy generation scored by the task's metric, and sample
generations beside their references where no metric scores them.

Every rank runs the same number of forward passes (FSDP all-gathers in lockstep): validation batches
are padded to equal counts, and generation uses `synced_gpus` so ranks that finish early keep
stepping until all are done. Because of that lockstep, every rank calls `after_batch` after the same batches: the
trainer's place to let the ranks agree to stop (it raises to abandon the evaluation).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import PreTrainedTokenizerBase, StoppingCriteria, StoppingCriteriaList

from shardline.data.loader import Batch
from shardline.data.render import generation_prompt
from shardline.data.template import encode_prompt, stop_ids
from shardline.example import Example
from shardline.parallel.fsdp import data_parallel_rank
from shardline.spec import JobSpec
from shardline.tasks import GenerationScores, Task
from shardline.training.generation import generate_left_padded
from shardline.training.loss import rank_part, token_loss_sum

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
