"""Data formats: how a row is recognised and read into an `Example`, one small description per format.

A format names the columns it needs (through `data.columns`, so a source's own names map onto them), an example
row for the docs, and a reader that turns one row into an `Example` or says, by `RowProblem`, what is wrong with
it. `data.format: auto` picks the first format whose columns the first row has, in the order of `FORMATS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardline.data.example import ROLES, Example
from shardline.errors import DataError
from shardline.spec import ColumnsSpec, DataSpec


class RowProblem(ValueError):
    """A row this format cannot read: `field` (the source's column) and what is wrong."""

    def __init__(self, field: str, problem: str, reason: str):
        super().__init__(f"{field}: {problem}")
        self.field, self.problem, self.reason = field, problem, reason


@dataclass(frozen=True)
class Format:
    name: str
    needs: tuple[str, ...]
    """`ColumnsSpec` fields a row must have (the source column names come from `data.columns`)."""
    optional: tuple[str, ...]
    example: dict[str, Any]
    """One row of this format, as the docs show it."""
    read: Callable[[dict[str, Any], ColumnsSpec], Example]
    chat: bool
    """Rendered with the tokenizer's chat template whatever `data.prompt_format` says (conversations)."""


def _string(row: dict[str, Any], column: str, required: bool = True) -> str:
    value = row.get(column)
    if value is None:
        if required:
            raise RowProblem(column, "is missing", "missing_column")
        return ""
    if not isinstance(value, str):
        raise RowProblem(column, f"is a {type(value).__name__}, not text", "not_text")
    return value


def _turns(value: Any, column: str, role_key: str, content_key: str, roles: dict[str, str]) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise RowProblem(column, f"is a {type(value).__name__}, not a list of turns", "not_a_conversation")
    turns = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise RowProblem(column, f"turn {i} is not a {{{role_key!r}, {content_key!r}}} object",
                             "not_a_conversation")
        role, content = roles.get(turn[role_key]), turn[content_key]
        if role is None:
            raise RowProblem(column, f"turn {i} has the role {turn[role_key]!r}, not one of {sorted(roles)}",
                             "unknown_role")
        if not isinstance(content, str):
            raise RowProblem(column, f"turn {i}'s {content_key} is a {type(content).__name__}, not text",
                             "not_text")
        turns.append({"role": role, "content": content})
    return turns


def _conversation(turns: list[dict[str, str]], column: str, trained_from: int = 0) -> Example:
    if not any(t["role"] == "assistant" for t in turns[trained_from:]):
        raise RowProblem(column, "has no assistant turn to learn from", "no_assistant_turn")
    return Example(messages=turns, trained_from=trained_from)


_CHAT_ROLES = {r: r for r in ROLES}
_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                   "assistant": "assistant", "tool": "tool", "observation": "tool", "function_response": "tool"}


def _messages(row: dict[str, Any], c: ColumnsSpec) -> Example:
    return _conversation(_turns(row.get(c.messages), c.messages, "role", "content", _CHAT_ROLES), c.messages)


def _sharegpt(row: dict[str, Any], c: ColumnsSpec) -> Example:
    turns = _turns(row.get(c.conversations), c.conversations, "from", "value", _SHAREGPT_ROLES)
    return _conversation(turns, c.conversations)


def _prompt_completion(row: dict[str, Any], c: ColumnsSpec) -> Example:
    prompt, completion = row.get(c.prompt), row.get(c.completion)
    if isinstance(prompt, list) or isinstance(completion, list):  # conversational: lists of turns
        before = _turns(prompt, c.prompt, "role", "content", _CHAT_ROLES)
        after = _turns(completion, c.completion, "role", "content", _CHAT_ROLES)
        return _conversation(before + after, c.completion, trained_from=len(before))
    prompt, completion = _string(row, c.prompt), _string(row, c.completion)
    if not completion.strip():
        raise RowProblem(c.completion, "is empty", "empty")
    return Example(prompt=prompt, answer=completion)


def _preference(row: dict[str, Any], c: ColumnsSpec) -> Example:
    """A prompt with a chosen and a rejected completion: all text, or (TRL's conversational form) the prompt a list
    of turns and each completion a list of assistant turns."""
    prompt = row.get(c.prompt)
    if isinstance(prompt, list):
        before = _turns(prompt, c.prompt, "role", "content", _CHAT_ROLES)
        chosen = _turns(row.get(c.chosen), c.chosen, "role", "content", _CHAT_ROLES)
        rejected = _turns(row.get(c.rejected), c.rejected, "role", "content", _CHAT_ROLES)
        ex = _conversation(before + chosen, c.chosen, trained_from=len(before))
        _conversation(before + rejected, c.rejected, trained_from=len(before))
        if chosen == rejected:
            raise RowProblem(c.rejected, f"equals {c.chosen}: the pair prefers nothing", "chosen_equals_rejected")
        if any(not t["content"].strip() for t in chosen + rejected if t["role"] == "assistant"):
            raise RowProblem(c.chosen, "or rejected has an empty assistant turn", "empty")
        return Example(messages=ex.messages, trained_from=ex.trained_from, rejected_turns=rejected)
    prompt, chosen, rejected = _string(row, c.prompt), _string(row, c.chosen), _string(row, c.rejected)
    for column, text in ((c.chosen, chosen), (c.rejected, rejected)):
        if not text.strip():
            raise RowProblem(column, "is empty", "empty")
    if chosen == rejected:
        raise RowProblem(c.rejected, f"equals {c.chosen}: the pair prefers nothing", "chosen_equals_rejected")
    return Example(prompt=prompt, answer=chosen, rejected=rejected)


def _prompt_answer(question: str, context: str, answer: str, fields: tuple[str, str]) -> Example:
    if not question.strip():
        raise RowProblem(fields[0], "is empty", "empty")
    if not answer.strip():
        raise RowProblem(fields[1], "is empty", "empty")
    return Example(question=question.strip(), context=context.strip(), answer=answer.strip())


def _instruction(row: dict[str, Any], c: ColumnsSpec) -> Example:
    return _prompt_answer(_string(row, c.instruction), _string(row, c.input, required=False),
                          _string(row, c.output), (c.instruction, c.output))


def _question_answer(row: dict[str, Any], c: ColumnsSpec) -> Example:
    ex = _prompt_answer(_string(row, c.question), _string(row, c.context, required=False),
                        _string(row, c.answer), (c.question, c.answer))
    db_id = row.get("db_id")
    return Example(ex.question, ex.context, ex.answer, str(db_id) if db_id is not None else "")


def _text(row: dict[str, Any], c: ColumnsSpec) -> Example:
    text = _string(row, c.text)
    if not text.strip():
        raise RowProblem(c.text, "is empty", "empty")
    return Example(text=text)


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("messages", ("messages",), (), {"messages": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]},
        _messages, chat=True),
    Format("conversations", ("conversations",), (), {"conversations": [
        {"from": "human", "value": "Capital of France?"}, {"from": "gpt", "value": "Paris."}]},
        _sharegpt, chat=True),
    Format("preference", ("prompt", "chosen", "rejected"), (),
           {"prompt": "Capital of France? Answer:", "chosen": " Paris.", "rejected": " Lyon."}, _preference,
           chat=False),
    Format("prompt_completion", ("prompt", "completion"), (),
           {"prompt": "Capital of France? Answer:", "completion": " Paris."}, _prompt_completion, chat=False),
    Format("instruction", ("instruction", "output"), ("input",),
           {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
           _instruction, chat=False),
    Format("question_answer", ("question", "answer"), ("context",),
           {"question": "How many users?", "context": "CREATE TABLE users (id INTEGER)",
            "answer": "SELECT COUNT(*) FROM users"}, _question_answer, chat=False),
    Format("text", ("text",), (), {"text": "A document of any length; longer ones are split, never dropped."},
           _text, chat=False),
)}


def columns_of(fmt: Format, columns: ColumnsSpec) -> list[str]:
    """The source column names `fmt` needs, under the spec's column map."""
    return [getattr(columns, f) for f in fmt.needs]


def detect(row: dict[str, Any], spec: DataSpec, where: str) -> Format:
    """The format `data.format` names, or the first whose columns `row` has (`auto`)."""
    if spec.format != "auto":
        fmt = FORMATS[spec.format]
        missing = [c for c in columns_of(fmt, spec.columns) if c not in row]
        if missing:
            raise DataError(where, f"data.format={fmt.name} needs the columns {missing}, but the rows have "
                            f"{sorted(row)}", _column_fix(fmt))
        return fmt
    for fmt in FORMATS.values():
        if all(c in row for c in columns_of(fmt, spec.columns)):
            return fmt
    accepted = "; ".join(f"{f.name}: {', '.join(columns_of(f, spec.columns))}" for f in FORMATS.values())
    raise DataError(where, f"the rows have the columns {sorted(row)}, which match no data format "
                    f"(each needs: {accepted})",
                    "rename your columns, or map them with data.columns.<field>=<your column> "
                    "(e.g. --set data.columns.messages=chat), and set data.format to the format (docs/data.md)")


def _column_fix(fmt: Format) -> str:
    return ("map your column names with " + ", ".join(f"data.columns.{f}=<your column>" for f in fmt.needs)
            + ", or set data.format to the format your rows have (or auto)")
