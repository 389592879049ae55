"""The benchmark task: random-token rows (`shardline.data.synthetic`), no prompt, validation loss only."""

from __future__ import annotations

from shardline.tasks.base import PromptTemplate, Task

RANDOM_TOKENS_TASK = Task(
    name="random_tokens",
    prompt=PromptTemplate(plain=lambda question, context: question, chat=lambda question, context: question,
                          version="random_tokens-1"),
    bundled_splits=None,
    score=None,
)
