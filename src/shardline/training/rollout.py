"""GRPO's rollouts: the training prompts, G completions of each sampled by the model itself, and the packed
micro-batches the policy is trained on.

Sampling is seeded by (`train.seed`, step, data-parallel rank) inside a forked RNG, so a step's completions
depend only on the weights and the step: a run resumed exactly samples the same completions, and the sampling
never moves the RNG streams dropout draws from. A prompt and its completion are one document; the completions of
a micro-batch are packed into rows with per-document attention, never padded to one length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from shardline.data.loader import Batch, make_batch
from shardline.data.packing import Document, assign_rows, pack
from shardline.data.render import generation_prompt
from shardline.example import Example
from shardline.spec import PromptFormat
from shardline.tasks.base import PromptTemplate
from shardline.training.generation import generate_left_padded

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class PromptPool:
    """The training examples GRPO samples completions for: their prompt ids and the ids generation stops at."""

    examples: list[Example]
    ids: list[list[int]]
    stops: list[list[int]]
    too_long: int
    """Examples dropped because prompt + `max_new_tokens` exceeds `train.seq_len`."""


def prompt_pool(examples: list[Example], tok: PreTrainedTokenizerBase, template: PromptTemplate, fmt: PromptFormat,
                room: int) -> PromptPool:
    """The examples that ask something (not raw text) with prompts of at most `room` tokens."""
    pool = PromptPool([], [], [], 0)
    for ex in examples:
        asked = generation_prompt(tok, ex, template, fmt)
        if asked is None:
            continue
        if len(asked[0]) > room:
            pool.too_long += 1
            continue
        pool.examples.append(ex)
        pool.ids.append(asked[0])
        pool.stops.append(asked[2])
    return pool


@dataclass
class Completions:
    """Completions of one rank's prompts, each prompt's G consecutive: ids (through the stop token when one ended
    it) and whether generation ended there (False: cut at `max_new_tokens`)."""

    ids: list[list[int]]
    ended: list[bool]

    def rows(self, kept: list[int]) -> Completions:
        """The completions at these indices, in their order."""
        return Completions([self.ids[r] for r in kept], [self.ended[r] for r in kept])


def sampling_seed(seed: int, step: int, rank: int, share: int = 0) -> int:
    """The seed of a step's sampling on a data-parallel rank (of its `share`-th prompt share, when oversampled)."""
    return int(np.random.SeedSequence([seed, step, rank, *([share] if share else [])]).generate_state(1)[0])


@torch.no_grad()
def sample_completions(model: nn.Module, prompts: list[list[int]], stops: list[list[int]], generations: int,
                       temperature: float, top_p: float, max_new_tokens: int, pad: int, device: torch.device,
                       synced: bool, seed: int) -> Completions:
    """`generations` sampled continuations of each prompt (KV cache), left-padded into one `generate` call."""
    repeated = [p for p in prompts for _ in range(generations)]
    stop = sorted({t for s in stops for t in s})
    devices = [device] if device.type == "cuda" else []
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = generate_left_padded(model, repeated, pad, device, do_sample=True, temperature=temperature,
                                       top_p=top_p, top_k=0, max_new_tokens=max_new_tokens, eos_token_id=stop,
                                       synced_gpus=synced)
    finally:
        model.train(was_training)
    completions = Completions([], [])
    for i, row in enumerate(out):
        own = set(stops[i // generations])
        end = next((j for j, t in enumerate(row) if t in stop), None)
        if end is None:
            completions.ids.append(row)
            completions.ended.append(False)
        else:
            completions.ids.append(row[: end + 1])
            completions.ended.append(row[end] in own)
    return completions


@dataclass
class RolloutBatch:
    """One micro-batch of packed completions: the batch, and which completion (this rank's index) each of its
    documents is, in the batch's document order."""

    batch: Batch
    completions: np.ndarray


@dataclass
class SampledBatch:
    """One sampling's completions on this rank, trained by the `train.grpo.num_iterations` steps from `step` on."""

    step: int
    """The step that sampled them (counted from 1)."""
    index: np.ndarray
    """This rank's prompts (training example indices)."""
    batches: list[RolloutBatch]
    advantages: torch.Tensor
    """Every completion's advantage, this rank's completions' order."""
    sums: torch.Tensor
    """This rank's sums of the reward metrics (`shardline.training.grpo.METRICS`); the KL and clip are per step."""
    generation_s: float
    reward_s: float
    old_logps: list[torch.Tensor | None]
    """Per micro-batch, the log-probabilities the completions were sampled with (π_old): the first step's forward,
    kept when a later step trains the batch again."""


def rollout_batches(prompts: list[list[int]], completions: list[list[int]], micro: int, seq_len: int,
                    pad: int) -> list[RolloutBatch]:
    """The completions in micro-batches of `micro`, each packed into rows: a document is its prompt (no loss)
    then its completion (loss)."""
    out = []
    for start in range(0, len(completions), micro):
        members = list(range(start, min(start + micro, len(completions))))
        docs = [Document(np.asarray(prompts[i] + completions[i], dtype=np.int32), n_prompt=len(prompts[i]))
                for i in members]
        rows = pack(docs, seq_len, pad)
        order = [members[j] for row in assign_rows([len(d.ids) for d in docs], seq_len, True) for j in row]
        out.append(RolloutBatch(make_batch(rows, np.arange(len(rows.n_real))), np.asarray(order)))
    return out


def decoded(tok: PreTrainedTokenizerBase, ids: list[list[int]]) -> list[str]:
    return [tok.decode(i, skip_special_tokens=True).strip() for i in ids]

