"""Tasks: what the examples are for, chosen by `data.task` (the trainer itself knows none of them).

A task supplies its data set for runs without `data.path`, the words of its prompt, and a metric that scores
generated text (`shardline.tasks.base.Task`). A task's modules are imported only when it is chosen, so a run of
one task never loads another's code.
"""

from __future__ import annotations

from collections.abc import Callable

from shardline.spec import TaskName
from shardline.tasks.base import GenerationScores, Rewards, Splits, Task

__all__ = ["TASKS", "GenerationScores", "Rewards", "Splits", "Task", "get_task"]


def _text_to_sql() -> Task:
    from shardline.tasks.text_to_sql import TEXT_TO_SQL

    return TEXT_TO_SQL


def _none() -> Task:
    from shardline.tasks.none import NONE

    return NONE


def _random_tokens() -> Task:
    from shardline.tasks.random_tokens import RANDOM_TOKENS_TASK

    return RANDOM_TOKENS_TASK


TASKS: dict[str, Callable[[], Task]] = {"text_to_sql": _text_to_sql, "none": _none, "random_tokens": _random_tokens}
"""Every value of `data.task`, each with the function that imports its task."""


def get_task(name: TaskName) -> Task:
    """The task `data.task` names (the spec admits only names listed in TASKS)."""
    return TASKS[name]()
