"""What a task is: its own data (if any), its prompt words and its generation metric (if any)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from shardline.example import Example
from shardline.spec import DataSpec


@dataclass(frozen=True)
class PromptTemplate:
    """How a task turns an example's question and context into prompt text."""

    plain: Callable[[str, str], str]
    """(question, context) → the whole prompt of `data.prompt_format: plain`; the answer follows it directly."""
    chat: Callable[[str, str], str]
    """(question, context) → the user message of `data.prompt_format: chat` (the tokenizer's template wraps it)."""
    version: str
    """Changes whenever the text does: part of the dataset version, so a new text is prepared anew."""


Splits = dict[str, list[Example]]
"""Examples by split: `train`, `validation`, `test`."""


@dataclass
class GenerationScores:
    """A generation metric's verdict on one set of greedy generations."""

    scores: dict[str, float]
    """Named scores (0-1): the keys of the `eval` records in metrics.jsonl, of summary.json and eval.json."""
    n: int
    """Examples scored."""
    metric: str
    """What the scores mean, in words (shown in the run report)."""
    headline: str
    """One line for the console."""
    samples: list[dict] = field(default_factory=list)
    """Per example: `question`, `gold`, `pred` and, where the metric gives one, a bool `match`."""


@dataclass
class Rewards:
    """A reward's verdict on completions: one number each, and where the task can tell, whether each solved its
    example (the run's `solved` share)."""

    values: list[float]
    solved: list[bool] | None = None


@dataclass(frozen=True)
class Task:
    """A task the trainer can run: everything it knows about the text it trains on comes through here."""

    name: str
    prompt: PromptTemplate
    bundled_splits: Callable[[DataSpec], Splits] | None
    """The task's own data set, used when `data.path` is unset (drawn with `data.seed` and the split sizes);
    None: the task brings no data."""
    score: Callable[[list[Example], list[str], DataSpec], GenerationScores] | None
    """Scores the greedy generations (one per example, the prompt's continuation up to the answer's end);
    None: the task has no generation metric, and validation loss is its only evaluation."""
    reward: Callable[[list[Example], list[str], DataSpec], Rewards] | None = None
    """GRPO's built-in reward of completions (one example per completion; `train.grpo.reward: auto`); None: the
    task has none, and a GRPO run names its own reward function."""
