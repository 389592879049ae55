"""GRPO's reward (`train.grpo.reward`): the task's own, or a user's function called as TRL calls one.

A user's function is `module:function`, imported on every worker (the run's working directory and PYTHONPATH are on
the import path). It is called with keyword lists, one entry per completion: `prompts` and `completions` (text)
and the rows' columns `question`, `context`, `answer` (the row's reference completion), `db_id` and `source`, and
returns one number per completion. A function that raises, returns the wrong count or a non-number (None, NaN, a
string) stops the run with an error naming the function and the completion: a reward is never silently skipped.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable

from shardline.errors import ShardlineError, SpecError
from shardline.example import Example
from shardline.spec import DataSpec
from shardline.tasks import Rewards, Task

RewardFn = Callable[[list[Example], list[str], list[str]], Rewards]
"""(examples, prompts, completions) → rewards: one example, prompt text and completion text per completion."""

COLUMNS = ("question", "context", "answer", "db_id", "source")
"""The row columns a user's reward function receives (as TRL passes a dataset's columns)."""


def reward_function(name: str, task: Task, data: DataSpec) -> RewardFn:
    """`train.grpo.reward` resolved: `auto`, the task's reward; else the named function, imported now."""
    if name == "auto":
        if task.reward is None:
            raise SpecError("train.grpo.reward", f"is auto, but data.task={task.name} has no built-in reward",
                            "name your function: train.grpo.reward=my_module:my_reward")
        builtin = task.reward
        return lambda examples, prompts, completions: builtin(examples, completions, data)
    module_name, attr = name.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise SpecError("train.grpo.reward", f"names module {module_name}, which does not import here ({e})",
                        "put the module on every worker's import path (the run's working directory or PYTHONPATH), "
                        "or ship it in the image") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise SpecError("train.grpo.reward", f"names {attr}, which module {module_name} does not define as a "
                        "function", f"define def {attr}(prompts, completions, **columns) in {module_name}")
    return lambda examples, prompts, completions: _call_user(name, fn, examples, prompts, completions)


def _call_user(name: str, fn: Callable, examples: list[Example], prompts: list[str],
               completions: list[str]) -> Rewards:
    columns = {c: [getattr(ex, c) for ex in examples] for c in COLUMNS}
    try:
        values = fn(prompts=prompts, completions=completions, **columns)
    except Exception as e:
        raise ShardlineError("train.grpo.reward", f"{name} raised {type(e).__name__}: {e} (scoring "
                             f"{len(completions)} completions, the first of prompt {prompts[0][-120:]!r})",
                             "fix the reward function; it must return one number per completion") from e
    try:
        values = list(values)
    except TypeError:
        values = None
    if values is None or len(values) != len(completions):
        got = "not a list" if values is None else f"{len(values)} values"
        raise ShardlineError("train.grpo.reward", f"{name} returned {got} for {len(completions)} completions",
                             "return one number per completion, in their order")
    for i, v in enumerate(values):
        if not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
            raise ShardlineError("train.grpo.reward", f"{name} returned {v!r} for completion {i} "
                                 f"({completions[i][:120]!r}), not a finite number",
                                 "return a float (or int) for every completion; score a bad one low, not None")
    return Rewards([float(v) for v in values])
