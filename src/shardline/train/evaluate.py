"""Evaluation on the sharded model: validation loss, and greedy SQL generation scored by execution.

Every rank runs the same number of forward passes (FSDP all-gathers in lockstep): validation batches
are padded to equal counts, and generation uses `synced_gpus` so ranks that finish early keep
stepping until all are done.
"""

from __future__ import annotations

import contextlib
import sqlite3
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedTokenizerBase

from shardline.data.generate import Example, generate_databases
from shardline.data.loader import IGNORE_INDEX, Batch
from shardline.data.sql_exec import execution_match
from shardline.data.template import encode_prompt
from shardline.spec import JobSpec


def token_loss_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Summed next-token cross-entropy over loss-bearing positions, in fp32."""
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


@torch.no_grad()
def validation_loss(model: nn.Module, batches: list[Batch], device: torch.device) -> float:
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in batches:
        b = batch.to(device)
        total[0] += token_loss_sum(model, b).double()
        total[1] += b.n_loss_tokens
    dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1].clamp(min=1))


@dataclass
class SqlEvalResult:
    accuracy: float
    n: int
    samples: list[dict]


def _databases(spec: JobSpec) -> dict[str, sqlite3.Connection]:
    if spec.data.path is not None:
        return {}
    return {db_id: db.connect() for db_id, db in generate_databases(spec.data.seed).items()}


def _schema_only_db(context: str) -> sqlite3.Connection:
    """For user data without a database: empty tables from the CREATE statements."""
    conn = sqlite3.connect(":memory:")
    with contextlib.suppress(sqlite3.Error):
        conn.executescript(context)
    return conn


@torch.no_grad()
def _generate(model: nn.Module, tok: PreTrainedTokenizerBase, prompts: list[list[int]], pad: int,
              max_new_tokens: int, device: torch.device, synced: bool) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id, pad_token_id=pad,
                         use_cache=True, synced_gpus=synced)
    return [row[width:].tolist() for row in out.cpu()]


def sql_execution_eval(model: nn.Module, tok: PreTrainedTokenizerBase, examples: list[Example], spec: JobSpec,
                       pad: int, device: torch.device, batch_size: int = 16) -> SqlEvalResult:
    """Greedy-generate SQL for `examples` (split over ranks) and compare execution results on rank 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = -(-len(examples) // world)
    mine = list(range(rank * per_rank, min(len(examples), (rank + 1) * per_rank)))
    n_batches = -(-per_rank // batch_size)
    model.eval()
    predictions: list[tuple[int, str]] = []
    for b in range(n_batches):
        index = mine[b * batch_size : (b + 1) * batch_size]
        todo = index or [0]  # a rank with no work still steps in lockstep
        prompts = [encode_prompt(tok, examples[i].question, examples[i].context, spec.data.prompt_format)
                   for i in todo]
        outputs = _generate(model, tok, prompts, pad, spec.train.eval_max_new_tokens, device, world > 1)
        if index:
            texts = [tok.decode(o, skip_special_tokens=True).strip() for o in outputs]
            predictions += list(zip(index, texts, strict=True))
    model.train()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, predictions)
    if rank != 0:
        return SqlEvalResult(accuracy=float("nan"), n=0, samples=[])
    dbs = _databases(spec)
    samples = []
    for i, pred in sorted(p for part in gathered for p in part):
        ex = examples[i]
        conn = dbs.get(ex.db_id) or _schema_only_db(ex.context)
        samples.append({"question": ex.question, "gold": ex.answer, "pred": pred,
                        "match": execution_match(conn, pred, ex.answer)})
    correct = sum(s["match"] for s in samples)
    return SqlEvalResult(accuracy=correct / max(1, len(samples)), n=len(samples), samples=samples)
