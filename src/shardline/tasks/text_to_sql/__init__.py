"""Text-to-SQL, the embedded default's task: a generated set of questions over small sqlite databases, a
schema + question prompt, and SQL generated for the test questions scored by test-suite execution accuracy."""

from __future__ import annotations

from shardline.spec import DataSpec
from shardline.tasks.base import Splits, Task
from shardline.tasks.text_to_sql.generate import generate_splits
from shardline.tasks.text_to_sql.pairs import with_rejected
from shardline.tasks.text_to_sql.prompt import SQL_PROMPT
from shardline.tasks.text_to_sql.reward import sql_reward
from shardline.tasks.text_to_sql.score import score_sql

DEFAULT_TRAIN_SIZE = 4000  # generated training examples when data.train_size is null


def generated_splits(data: DataSpec) -> Splits:
    """The generated set, drawn with `data.seed` in the sizes `data` asks for; with `data.format: preference`, each
    example a pair (the gold query chosen, a wrong one rejected: `pairs`)."""
    splits = generate_splits(data.seed, data.train_size or DEFAULT_TRAIN_SIZE, data.validation_size, data.test_size)
    return with_rejected(splits, data.seed) if data.format == "preference" else splits


TEXT_TO_SQL = Task(name="text_to_sql", prompt=SQL_PROMPT, bundled_splits=generated_splits, score=score_sql,
                   reward=sql_reward)
