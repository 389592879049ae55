"""What the training loop asks of an objective (SFT, DPO, GRPO): the protocol, and the run it reads.

The loop (`training.trainer.Trainer`) never asks which objective it runs. Per step it asks the objective to draw
(`sample`: a sampling objective generates, the others return at once), for the step's micro-batches
(`step_batches`), to begin the step with the global count of loss-bearing tokens (`begin_step`), for each
micro-batch's forward (`micro_batch`: a context that yields the micro-batch's share of the global loss and holds
the contexts its backward needs), and for the step's own metrics (`end_step`, fields of the train record).

Loss convention: every objective's shares, summed over the micro-batches of every rank, are the step's loss (a
tensor-parallel group's ranks each hold the same shares). The loop backpropagates `share.loss × FSDP ranks` (FSDP
averages the gradients over them) and reports Σ `share.value` / tp: no objective-specific division in the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from shardline.data.loader import Batch, StepSampler
from shardline.data.prepare import PreparedData
from shardline.parallel.mesh import DistContext
from shardline.spec import JobSpec
from shardline.tasks import Task

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PreTrainedTokenizerBase


@dataclass
class Run:
    """What an objective reads of the run it trains: the spec, the ranks, the data and the policy being trained."""

    spec: JobSpec
    ctx: DistContext
    data: PreparedData
    model: nn.Module
    tokenizer: PreTrainedTokenizerBase
    task: Task
    run_dir: Path
    dp_rank: int
    dp_world: int
    cp_mesh: DeviceMesh | None
    frozen_copy: Callable[[], nn.Module]
    """Builds a frozen copy of the starting weights, sharded like the policy (a reference policy's)."""
    say: Callable[[str], None]
    event: Callable[..., None]
    after_validation_batch: Callable[[], None]
    """Every rank after each validation batch: a drill's fault point, a stop the ranks agreed on."""


@dataclass
class Share:
    """One micro-batch's share of the step's global loss."""

    loss: torch.Tensor
    """Differentiable: the loop backpropagates `loss × FSDP ranks`."""
    value: torch.Tensor
    """Its float64 value (detached), summed over micro-batches and ranks into the step's reported loss."""


@dataclass
class StepBatches:
    """A step's micro-batches on this rank, and the row indices each came from (the rows trace, DPO's table)."""

    batches: list[Batch]
    indices: list


@dataclass
class Validation:
    """An objective's validation: its loss, the fields of its `eval` record and its console line."""

    loss: float
    fields: dict[str, Any]
    line: str


class Objective(Protocol):
    """A training objective: how a step's batches turn into a loss and its metrics, how it is validated, what it
    checkpoints. One file per objective in this package; `objectives.build` chooses by `train.objective`."""

    sampler: StepSampler
    """What each step draws: training rows (SFT, DPO) or prompts (GRPO)."""
    steps_per_sampling: int
    """Steps trained on one draw of samples: a checkpoint resumes exactly only at a multiple (1: every step)."""
    sampling_field: str | None
    """The spec field that sets `steps_per_sampling` (named where it lengthens the grace a stop needs)."""
    validates_first: bool
    """Whether a new run validates at step 0, before its first step (the report's first point)."""
    supports_context_parallel: bool

    def prepare(self) -> None:
        """Before the resume: what training needs and an evaluation does not (GRPO's prompts and reward)."""

    def start(self, step: int) -> None:
        """After the resume, before the first step (DPO's precomputed reference at step 0)."""

    def describe(self) -> list[str]:
        """Setup lines for the console."""

    def state(self) -> dict[str, Any]:
        """Objective state every checkpoint holds beside the counters (its keys are the checkpoint's), tensors
        loaded in place; {} for none."""

    def sample(self, step: int) -> float:
        """Draw what step `step` + 1 trains on where it samples (GRPO's rollouts); the seconds that took."""

    def step_batches(self, step: int) -> StepBatches:
        """Step `step` + 1's micro-batches on this rank, on the device."""

    def begin_step(self, loss_tokens: torch.Tensor) -> None:
        """The step's global count of loss-bearing tokens (all-reduced); its own global counts, all-reduced here."""

    def micro_batch(self, k: int, batch: Batch) -> AbstractContextManager[Share]:
        """The forward of micro-batch `k` inside the contexts its backward needs too; yields its `Share`."""

    def end_step(self) -> dict[str, Any]:
        """After the last micro-batch (before clipping): the step's metrics, reduced over ranks, as extra fields
        of the train record."""

    def validate(self) -> Validation:
        """The objective's validation over every validation row (every rank calls it)."""

    def trend(self, first: Any, last: Any) -> str:
        """What moved from the first train record to the last, for the closing line."""

