"""The task for a user's own data: a neutral prompt, no data of its own, validation loss only."""

from __future__ import annotations

from shardline.tasks.base import PromptTemplate, Task


def _message(question: str, context: str) -> str:
    """The question or instruction, a blank line, the context or input (when there is one): nothing the data does
    not say, in the order Alpaca, LLaMA-Factory and Axolotl write an instruction and its input."""
    return "\n\n".join(part for part in (question, context) if part)


NONE = Task(
    name="none",
    prompt=PromptTemplate(plain=lambda question, context: _message(question, context) + "\n", chat=_message,
                          version="none-2"),
    bundled_splits=None,
    score=None,
)
