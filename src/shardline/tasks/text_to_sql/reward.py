"""GRPO's built-in text-to-SQL reward: 1 for a query whose result equals the gold's on every database of its
question's test suite (the metric the run is evaluated by), plus 0.1 for a query that runs at all."""

from __future__ import annotations

import sqlite3
from functools import lru_cache

from shardline.data.example import Example
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
    share it)."""
    databases = _databases(data.seed) if data.path is None else {}
    values, solved = [], []
    suites: dict[tuple[str, str, str], list[sqlite3.Connection]] = {}
    try:
        for ex, pred in zip(examples, completions, strict=True):
            key = (ex.db_id, ex.context, ex.answer)
            if key not in suites:
                base = databases[ex.db_id].connect() if ex.db_id in databases else None
                suites[key] = suite_databases(ex.context, ex.answer, SUITE_SIZE, data.seed, base)
                if base is not None:
                    base.close()
            suite = suites[key]
            match = suite_match(suite, pred, ex.answer).match
            runs = bool(suite) and run_sql(suite[0], pred).rows is not None
            values.append(float(match) + RUNS_REWARD * runs)
            solved.append(match)
    finally:
        for suite in suites.values():
            for conn in suite:
                conn.close()
    return Rewards(values, solved)
