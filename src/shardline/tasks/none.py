"""The task for a user's own data: a neutral prompt, no data of its own, validation loss only."""

from __future__ import annotations

from shardline.data.template import PromptTemplate
from shardline.tasks.base import Task


def _message(question: str, context: str) -> str:
    """The context (when there is one), a blank line, the question: nothing the data does not say."""
    return "\n\n".join(part for part in (context, question) if part)


NONE = Task(
    name="none",
    prompt=PromptTemplate(plain=lambda question, context: _message(question, context) + "\n", chat=_message,
                          version="none-1"),
    bundled_splits=None,
    score=None,
)
