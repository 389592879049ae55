"""The text-to-SQL generation metric: each predicted query scored on its question's test suite of databases."""

from __future__ import annotations

import sqlite3

from shardline.example import Example
from shardline.spec import DataSpec
from shardline.tasks.base import GenerationScores
from shardline.tasks.text_to_sql.generate import Database, generate_databases
from shardline.tasks.text_to_sql.suite import exact_match, suite_databases, suite_match

SUITE_SIZE = 8  # generated databases per test question, after the real database where there is one
METRIC = (f"test-suite execution accuracy (Zhong et al., 2020): a prediction counts only if its result equals "
          f"the gold's on every database of its question's suite ({SUITE_SIZE} generated from the schema, with "
          f"values seeded by the gold's literals, after the real database where there is one); row order counts "
          f"only when the gold has ORDER BY; a gold that runs on no database counts as wrong")


def score_sql(examples: list[Example], predictions: list[str], data: DataSpec) -> GenerationScores:
    """Score predicted SQL: the generated set's real databases take part when the examples are the generated set."""
    databases = generate_databases(data.seed) if data.path is None else {}
    return score_predictions(examples, predictions, data.seed, databases)


def score_predictions(examples: list[Example], predictions: list[str], seed: int,
                      databases: dict[str, Database]) -> GenerationScores:
    """Score each prediction on its question's suite: the real database from ``databases`` (by ``db_id``) if
    any, then ``SUITE_SIZE`` generated from the context and the gold SQL with ``seed``."""
    real: dict[str, sqlite3.Connection] = {}
    samples = []
    for ex, pred in zip(examples, predictions, strict=True):
        if ex.db_id in databases and ex.db_id not in real:
            real[ex.db_id] = databases[ex.db_id].connect()
        suite = suite_databases(ex.context, ex.answer, SUITE_SIZE, seed, real.get(ex.db_id))
        result = suite_match(suite, pred, ex.answer)
        for conn in suite:
            conn.close()
        samples.append({"question": ex.question, "gold": ex.answer, "pred": pred, "match": result.match,
                        "exact_match": exact_match(pred, ex.answer), "databases": result.databases,
                        **({"gold_errors": result.gold_errors} if result.gold_errors else {})})
    for conn in real.values():
        conn.close()
    n = max(1, len(samples))
    accuracy = sum(s["match"] for s in samples) / n
    exact = sum(s["exact_match"] for s in samples) / n
    suite_size = max((s["databases"] for s in samples), default=0)
    headline = (f"SQL execution accuracy: {100 * accuracy:.1f}% (test suite, up to {suite_size} databases per "
                f"question) · exact match {100 * exact:.1f}% · {len(samples)} distinct test questions")
    return GenerationScores(scores={"sql_execution_accuracy": accuracy, "sql_exact_match": exact},
                            n=len(samples), metric=METRIC, headline=headline, samples=samples)
