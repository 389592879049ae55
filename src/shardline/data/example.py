"""The one record every data source yields and every task reads."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

Kind = Literal["prompt_answer", "chat", "text"]
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Example:
    """One example, in one of three kinds (`kind`), whatever format its row came in (`shardline.data.formats`):

    - prompt and answer: `question` and `context` are what the task's prompt template shows (text-to-SQL: the
      question and the CREATE TABLE schema), or `prompt` is the prompt's own text, used as it is; `answer` is the
      text that carries loss;
    - chat: `messages`, a conversation of `{"role", "content"}` turns rendered with the tokenizer's chat template;
      assistant turns from index `trained_from` on carry loss;
    - text: `text`, a raw document; every token carries loss.

    `db_id` names the record's source within its data set (text-to-SQL: the generated database the query runs on),
    `source` the data source it was read from; both empty when there is none.
    """

    question: str = ""
    context: str = ""
    answer: str = ""
    db_id: str = ""
    prompt: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    trained_from: int = 0
    text: str | None = None
    source: str = ""

    @property
    def kind(self) -> Kind:
        if self.messages:
            return "chat"
        return "text" if self.text is not None else "prompt_answer"

    def to_dict(self) -> dict:
        """Plain dict of the fields that are set (question, context, answer and db_id always)."""
        d = asdict(self)
        defaults = {"prompt": None, "messages": [], "trained_from": 0, "text": None, "source": ""}
        return {k: v for k, v in d.items() if k not in defaults or v != defaults[k]}
