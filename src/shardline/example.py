"""The one record every data source yields and every task reads."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

Kind = Literal["prompt_answer", "chat", "text"]
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Example:
    """One example, in one of three kinds (`kind`), whatever format its row came in (`shardline.data.formats`):

    - prompt and answer: `question` and `context` are what the task's prompt template shows (text-to-SQL: the
      question and the CREATE TABLE schema), or `prompt` is the prompt's own text, used as it is; `system`, when
      set, comes before it (a system turn under `data.prompt_format: chat`); `answer` is the text that carries loss;
    - chat: `messages`, a conversation of `{"role", "content"}` turns (with any other keys a turn has:
      `tool_calls`, `tool_call_id`, `name`, `reasoning_content`, ...) rendered with the tokenizer's chat template,
      offered the functions in `tools`; assistant turns from index `trained_from` on carry loss, but for those with
      `weight: 0` (context; `trained_turns`);
    - text: `text`, a raw document; every token carries loss.

    `db_id` names the record's source within its data set (text-to-SQL: the generated database the query runs on),
    `source` the data source it was read from; both empty when there is none.

    A preference pair (`preference`) is a prompt-and-answer or chat example whose answer (or assistant turns from
    `trained_from` on) is the chosen completion, with the rejected one beside it: `rejected` text, or
    `rejected_turns` replacing the chosen turns.
    """

    question: str = ""
    context: str = ""
    answer: str = ""
    db_id: str = ""
    prompt: str | None = None
    system: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    trained_from: int = 0
    tools: list[dict[str, Any]] | None = None
    text: str | None = None
    source: str = ""
    rejected: str | None = None
    rejected_turns: list[dict[str, Any]] = field(default_factory=list)

    @property
    def kind(self) -> Kind:
        if self.messages:
            return "chat"
        return "text" if self.text is not None else "prompt_answer"

    @property
    def preference(self) -> bool:
        return self.rejected is not None or bool(self.rejected_turns)

    def chosen_and_rejected(self) -> tuple[Example, Example]:
        """The pair as two plain examples: the prompt with the chosen completion, and with the rejected one."""
        plain = replace(self, rejected=None, rejected_turns=[])
        if self.kind == "chat":
            return plain, replace(plain, messages=self.messages[: self.trained_from] + self.rejected_turns)
        return plain, replace(plain, answer=self.rejected or "")

    def to_dict(self) -> dict:
        """Plain dict of the fields that are set (question, context, answer and db_id always)."""
        d = asdict(self)
        defaults = {"prompt": None, "system": "", "messages": [], "trained_from": 0, "tools": None, "text": None,
                    "source": "", "rejected": None, "rejected_turns": []}
        return {k: v for k, v in d.items() if k not in defaults or v != defaults[k]}


def trained_turns(messages: list[dict[str, Any]], trained_from: int = 0, assistant_turns: str = "all") -> list[int]:
    """The indices of the turns that carry loss: the assistant's, from `trained_from` on, but for those with
    `weight: 0` (kept as context); with `assistant_turns="last"` the last of them only. An assistant turn's loss
    covers all it says (its content, tool calls and end of turn); a tool's result never carries loss."""
    trained = [i for i, m in enumerate(messages)
               if i >= trained_from and m["role"] == "assistant" and m.get("weight", 1) != 0]
    return trained[-1:] if assistant_turns == "last" else trained


def needs_chat_template(ex: Example, fmt: str) -> bool:
    """Whether `ex` cannot render without a chat template (`auto` renders plain without one)."""
    return ex.kind == "chat" or (ex.kind == "prompt_answer" and fmt == "chat")
