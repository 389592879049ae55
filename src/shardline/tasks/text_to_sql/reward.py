"""GRPO's built-in text-to-SQL reward: 1 for a query whose result equals the gold's on every database of its
question's test suite (the metric the run is evaluated by), plus 0.1 for a query that runs at all."""

from __future__ import annotations

from functools import lru_cache

from shardline.example import Example
from shardline.spec import DataSpec
from shardline.tasks.base import Rewards
from shardline.tasks.text_to_sql.execution import run_sql
from shardline.tasks.text_to_sql.generate import Database, generate_databases
from shardline.tasks.text_to_sql.score import SUITE_SIZE
from shardline.tasks.text_to_sql.suite import suite_databases, suite_match

RUNS_REWARD = 0.1
"""The format reward: a completion that is one SELECT sqlite runs (on the suite's first database)."""


@lru_cache(maxsize=2)
def _databases(seed: int) -> dict[str, Database]:
    return generate_databases(seed)


def sql_reward(examples: list[Example], completions: list[str], data: DataSpec) -> Rewards:
    """Each completion's reward on its example's suite; one suite per distinct example (a group's G completions
    share it), built when its first completion is scored and closed before the next example's: one question's
    databases are alive at a time, not the batch's."""
    databases = _databases(data.seed) if data.path is None else {}
    by_question: dict[tuple[str, str, str], list[int]] = {}
    for i, (ex, _) in enumerate(zip(examples, completions, strict=True)):
        by_question.setdefault((ex.db_id, ex.context, ex.answer), []).append(i)
    values, solved = [0.0] * len(examples), [False] * len(examples)
    for indices in by_question.values():
        ex = examples[indices[0]]
        base = databases[ex.db_id].connect() if ex.db_id in databases else None
        suite = suite_databases(ex.context, ex.answer, SUITE_SIZE, data.seed, base)
        if base is not None:
            base.close()
        try:
            for i in indices:
                match = suite_match(suite, completions[i], ex.answer).match
                runs = bool(suite) and run_sql(suite[0], completions[i]).rows is not None
                values[i], solved[i] = float(match) + RUNS_REWARD * runs, match
        finally:
            for conn in suite:
                conn.close()
    return Rewards(values, solved)
