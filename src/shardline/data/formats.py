"""Data formats: how a row is recognised and read into an `Example`, one small description per format.

A format names the columns it needs (through `data.columns`, so a source's own names map onto them), an example
row for the docs, and a reader that turns one row into an `Example` or says, by `RowProblem`, what is wrong with
it. `data.format: auto` picks the first format whose columns the first row has, in the order of `DETECTION_ORDER`
(`FORMATS`' order, preference rows first).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from shardline.errors import DataError
from shardline.example import ROLES, Example, trained_turns
from shardline.spec import ColumnsSpec, DataSpec

READ_VERSION = "3"
"""The rules by which rows are read (2: tool calls, turn keys, weights and the tools and system columns kept, empty
assistant turns dropped, answers as written; 3: rows with `chosen` and `rejected` are preference pairs in TRL's,
LLaMA-Factory's and Anthropic HH's layouts): part of the dataset version, so data read by other rules is prepared
anew."""


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
    read: Callable[..., Example]
    """(row, columns, roles=None) → the example: `columns` the spec's column map, `roles` its `data.roles` (turn roles
    of other names, read as the role each names, besides the format's own)."""
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


def _turns(value: Any, column: str, role_key: str, content_key: str, roles: dict[str, str]) -> list[dict[str, Any]]:
    """A list of turns as the chat template takes them: `role` and `content` (text), and every other key the turn has
    (`tool_calls`, `tool_call_id`, `name`, `reasoning_content`, `weight`, ...) handed on, normalised (`_turn`)."""
    if not isinstance(value, list) or not value:
        raise RowProblem(column, f"is a {type(value).__name__}, not a list of turns", "not_a_conversation")
    return [_turn(turn, i, column, role_key, content_key, roles) for i, turn in enumerate(value)]


_CALL = "function_call"
"""ShareGPT's (LLaMA-Factory's) role of an assistant turn whose value is its tool call(s), as JSON."""


def _turn(turn: Any, i: int, column: str, role_key: str, content_key: str, roles: dict[str, str]) -> dict[str, Any]:
    if not isinstance(turn, dict) or role_key not in turn or \
            (content_key not in turn and "tool_calls" not in turn and "function_call" not in turn):
        raise RowProblem(column, f"turn {i} is not a {{{role_key!r}, {content_key!r}}} object", "not_a_conversation")
    role = roles.get(turn[role_key]) if isinstance(turn[role_key], str) else None
    if role is None:
        raise RowProblem(column, f"turn {i} has the role {turn[role_key]!r}, not one of {sorted(roles)}",
                         "unknown_role")
    where = f"turn {i}'s"
    if role == _CALL:
        out = {"role": "assistant", "content": "", "tool_calls": _tool_calls(turn.get(content_key), where, column)}
    else:
        out = {"role": role, "content": _content(turn.get(content_key), f"{where} {content_key}", column)}
    for key, value in turn.items():
        # None is an absent key (parquet gives every turn every key any turn has); role and content are read above.
        if value is None or key in (role_key, content_key, "role", "content"):
            continue
        if key == "function_call" and out["role"] == "assistant":  # OpenAI's legacy form of one tool call
            key, value = "tool_calls", out.get("tool_calls", []) + _tool_calls(value, where, column)
        elif key == "tool_calls":
            value = out.get("tool_calls", []) + _tool_calls(value, where, column)
            if not value:
                continue  # `tool_calls: []`: no call
        elif key == "weight":
            if value not in (0, 1):
                raise RowProblem(column, f"{where} weight is {value!r}: a turn is trained (1) or context (0)",
                                 "not_a_conversation")
            if value == 1:
                continue  # the default
            value = 0
        out[key] = value
    return out


def _content(value: Any, what: str, column: str) -> str:
    """A turn's content as text: a string as it is, null as "" (a turn that only calls tools), OpenAI's list of
    content parts as its text parts joined by line breaks."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RowProblem(column, f"{what} has a {kind!r} part: only text parts are read", "not_text")
        return "\n".join(texts)
    raise RowProblem(column, f"{what} is a {type(value).__name__}, not text", "not_text")


def _json(value: str, what: str, column: str) -> Any:
    try:
        return json.loads(value)
    except ValueError as e:
        raise RowProblem(column, f"{what} is not JSON ({e})", "not_a_conversation") from None


def _tool_calls(value: Any, where: str, column: str) -> list[dict[str, Any]]:
    """Tool calls in OpenAI's form, which chat templates read: `{"type": "function", "function": {"name",
    "arguments"}}` with the arguments an object (a JSON string is parsed), the call's other keys (`id`) kept. Read
    from that form, from TRL's and ShareGPT's `{"name", "arguments"}`, one call or a list, or JSON text of either."""
    if isinstance(value, str):
        value = _json(value, f"{where} tool call", column)
    if value is None:
        value = []
    calls = [value] if isinstance(value, dict) else value
    if not isinstance(calls, list):
        raise RowProblem(column, f"{where} tool_calls is a {type(value).__name__}, not a list of calls",
                         "not_a_conversation")
    out = []
    for k, call in enumerate(calls):
        what = f"{where} tool call {k}"
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise RowProblem(column, f"{what} has no function name (expected {{\"name\", \"arguments\"}}, or "
                             "OpenAI's {\"type\": \"function\", \"function\": {...}})", "not_a_conversation")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            arguments = _json(arguments, f"{what}'s arguments", column) if arguments.strip() else {}
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise RowProblem(column, f"{what}'s arguments are a {type(arguments).__name__}, not an object",
                             "not_a_conversation")
        keys = {key: v for key, v in call.items() if v is not None and key not in ("function", "name", "arguments")}
        inner = {key: v for key, v in function.items() if v is not None}
        out.append({**keys, "type": "function", "function": {**inner, "arguments": arguments}})
    return out


def _tools(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The row's `tools` column (the functions the conversation may call, handed to the chat template): a list of
    schemas, or JSON text of one; None when there is none."""
    value = row.get(TOOLS)
    if isinstance(value, str):
        value = _json(value, "the list of tools", TOOLS) if value.strip() else None
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise RowProblem(TOOLS, f"is a {type(value).__name__}, not a list of tool schemas", "not_a_conversation")
    return value


TOOLS, SYSTEM = "tools", "system"
"""Columns a conversation's row may have beside its turns: the tools it may call, and (LLaMA-Factory) its system
prompt, used when the conversation has no system turn of its own."""


def _with_system(row: dict[str, Any], turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    system = row.get(SYSTEM)
    if system is None or system == "" or turns[0]["role"] == "system":
        return turns
    if not isinstance(system, str):
        raise RowProblem(SYSTEM, f"is a {type(system).__name__}, not text", "not_text")
    return [{"role": "system", "content": system}, *turns]


def _conversation(turns: list[dict[str, Any]], column: str, trained_from: int = 0,
                  tools: list[dict[str, Any]] | None = None) -> Example:
    trained = trained_turns(turns, trained_from)
    if not trained:
        raise RowProblem(column, "has no assistant turn to learn from", "no_assistant_turn")
    for i in trained:
        if not turns[i]["content"].strip() and not turns[i].get("tool_calls"):
            raise RowProblem(column, f"turn {i} is an empty assistant turn", "empty")
    return Example(messages=turns, trained_from=trained_from, tools=tools)


_CHAT_ROLES = {r: r for r in ROLES} | {"function": "tool"}  # OpenAI's legacy role of a function's result
_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                   "assistant": "assistant", "tool": "tool", "observation": "tool", "function_response": "tool",
                   _CALL: _CALL}


Roles = dict[str, str] | None


def _messages(row: dict[str, Any], c: ColumnsSpec, roles: Roles = None) -> Example:
    turns = _turns(row.get(c.messages), c.messages, "role", "content", {**_CHAT_ROLES, **(roles or {})})
    return _conversation(_with_system(row, turns), c.messages, tools=_tools(row))


def _sharegpt(row: dict[str, Any], c: ColumnsSpec, roles: Roles = None) -> Example:
    turns = _turns(row.get(c.conversations), c.conversations, "from", "value", {**_SHAREGPT_ROLES, **(roles or {})})
    return _conversation(_with_system(row, turns), c.conversations, tools=_tools(row))


def _prompt_completion(row: dict[str, Any], c: ColumnsSpec, roles: Roles = None) -> Example:
    prompt, completion = row.get(c.prompt), row.get(c.completion)
    if isinstance(prompt, list) or isinstance(completion, list):  # conversational: lists of turns
        chat_roles = {**_CHAT_ROLES, **(roles or {})}
        before = _turns(prompt, c.prompt, "role", "content", chat_roles)
        after = _turns(completion, c.completion, "role", "content", chat_roles)
        return _conversation(before + after, c.completion, trained_from=len(before), tools=_tools(row))
    prompt, completion = _string(row, c.prompt), _string(row, c.completion)
    if not completion.strip():
        raise RowProblem(c.completion, "is empty", "empty")
    return Example(prompt=prompt, answer=completion)


def _preference(row: dict[str, Any], c: ColumnsSpec, roles: Roles = None) -> Example:
    """A prompt with a chosen and a rejected answer, in any of the layouts people keep pairs in:

    - TRL's: `prompt`, `chosen`, `rejected` all text, or the prompt a list of turns and each answer a list of
      assistant turns;
    - LLaMA-Factory's ShareGPT pairs: a `conversations` (or, with OpenAI's role/content keys, `messages`) list ending
      with the turn the answers reply to, `chosen` and `rejected` each an assistant turn (or a list of them), and the
      row's `system` and `tools` columns;
    - Anthropic HH's: `chosen` and `rejected` two whole conversations, lists of turns or HH's text
      ("\\n\\nHuman: ... \\n\\nAssistant: ..."), alike but for their last assistant turns: the rest is the prompt (as
      TRL's `extract_prompt` finds it; a prompt column in text beside them is ignored, as TRL ignores it).
    """
    prompt, chosen, rejected = row.get(c.prompt), row.get(c.chosen), row.get(c.rejected)
    if isinstance(prompt, list):  # TRL's conversational form
        chat_roles = {**_CHAT_ROLES, **(roles or {})}
        return _pair(_turns(prompt, c.prompt, "role", "content", chat_roles),
                     _turns(chosen, c.chosen, "role", "content", chat_roles),
                     _turns(rejected, c.rejected, "role", "content", chat_roles), c, _tools(row))
    if _whole_conversation(chosen, roles) or _whole_conversation(rejected, roles):
        return _implicit_prompt(row, c, roles)
    for column, role_key, content_key, known in ((c.conversations, "from", "value", _SHAREGPT_ROLES),
                                                 (c.messages, "role", "content", _CHAT_ROLES)):
        if column in row:
            return _sharegpt_pair(row, column, role_key, content_key, {**known, **(roles or {})}, c)
    if prompt is None and isinstance(chosen, str) and isinstance(rejected, str):
        return _hh_text(chosen, rejected, c)
    prompt, chosen, rejected = _string(row, c.prompt), _string(row, c.chosen), _string(row, c.rejected)
    return _text_pair(prompt, chosen, rejected, c)


def _text_pair(prompt: str, chosen: str, rejected: str, c: ColumnsSpec) -> Example:
    for column, text in ((c.chosen, chosen), (c.rejected, rejected)):
        if not text.strip():
            raise RowProblem(column, "is empty", "empty")
    if chosen == rejected:
        raise RowProblem(c.rejected, f"equals {c.chosen}: the pair prefers nothing", "chosen_equals_rejected")
    return Example(prompt=prompt, answer=chosen, rejected=rejected)


def _pair(before: list[dict[str, Any]], chosen: list[dict[str, Any]], rejected: list[dict[str, Any]],
          c: ColumnsSpec, tools: list[dict[str, Any]] | None) -> Example:
    """The conversational pair: the prompt's turns, then the chosen (or the rejected) assistant turns."""
    ex = _conversation(before + chosen, c.chosen, trained_from=len(before), tools=tools)
    _conversation(before + rejected, c.rejected, trained_from=len(before))
    if chosen == rejected:
        raise RowProblem(c.rejected, f"equals {c.chosen}: the pair prefers nothing", "chosen_equals_rejected")
    return Example(messages=ex.messages, trained_from=ex.trained_from, tools=ex.tools, rejected_turns=rejected)


def _whole_conversation(value: Any, roles: Roles) -> bool:
    """A list of turns that holds more than assistant turns: a prompt with its answer (HH's layout)."""
    known = {**_SHAREGPT_ROLES, **_CHAT_ROLES, **(roles or {})}
    return isinstance(value, list) and any(
        not isinstance(t, dict) or not isinstance(role := t.get("role", t.get("from")), str)
        or known.get(role) not in ("assistant", _CALL) for t in value)


def _keys_of(value: Any, roles: Roles) -> tuple[str, str, dict[str, str]]:
    """A list of turns' role and content keys, and the roles they may name: ShareGPT's `from`/`value`, else
    OpenAI's `role`/`content`."""
    first = value[0] if isinstance(value, list) and value else value
    if isinstance(first, dict) and "from" in first:
        return "from", "value", {**_SHAREGPT_ROLES, **(roles or {})}
    return "role", "content", {**_CHAT_ROLES, **(roles or {})}


def _implicit_prompt(row: dict[str, Any], c: ColumnsSpec, roles: Roles) -> Example:
    """Two whole conversations, alike but for their last assistant turns: the rest is the prompt."""
    chosen = _turns(row.get(c.chosen), c.chosen, *_keys_of(row.get(c.chosen), roles))
    rejected = _turns(row.get(c.rejected), c.rejected, *_keys_of(row.get(c.rejected), roles))
    if chosen[-1]["role"] != "assistant" or rejected[-1]["role"] != "assistant":
        raise RowProblem(c.chosen, f"and {c.rejected} must each end with an assistant turn: without a prompt column, "
                         "a pair is two conversations that differ in their last assistant turn", "not_a_conversation")
    if chosen[:-1] != rejected[:-1]:
        k = next((i for i, (a, b) in enumerate(zip(chosen, rejected, strict=False)) if a != b),
                 min(len(chosen), len(rejected)))
        raise RowProblem(c.chosen, f"and {c.rejected} differ before their last assistant turn (at turn {k}): without "
                         "a prompt column, the prompt is all the two conversations share but their last assistant "
                         "turns; give the prompt its own column", "not_a_conversation")
    return _pair(chosen[:-1], chosen[-1:], rejected[-1:], c, _tools(row))


def _sharegpt_pair(row: dict[str, Any], column: str, role_key: str, content_key: str, roles: dict[str, str],
                   c: ColumnsSpec) -> Example:
    """LLaMA-Factory's pair: the conversation up to the turn the answers reply to, each answer an assistant turn."""
    before = _with_system(row, _turns(row.get(column), column, role_key, content_key, roles))
    if before[-1]["role"] not in ("user", "tool"):
        raise RowProblem(column, f"ends with a {before[-1]['role']} turn: a pair's conversation ends with the turn "
                         f"its answers ({c.chosen}, {c.rejected}) reply to, the user's or a tool's",
                         "not_a_conversation")
    answers = []
    for name in (c.chosen, c.rejected):
        value = row.get(name)
        if isinstance(value, dict):
            value = [value]
        if not isinstance(value, list) or not value:
            raise RowProblem(name, f"is a {type(value).__name__}, not an assistant turn", "not_a_conversation")
        turns = _turns(value, name, *_keys_of(value, roles))
        wrong = next((i for i, t in enumerate(turns) if t["role"] != "assistant"), None)
        if wrong is not None:
            raise RowProblem(name, f"turn {wrong} is a {turns[wrong]['role']} turn: a pair's answers are assistant "
                             "turns", "not_a_conversation")
        answers.append(turns)
    return _pair(before, answers[0], answers[1], c, _tools(row))


_HH_ASSISTANT = "\n\nAssistant:"
"""What opens an assistant turn in Anthropic HH's text (a human's: "\\n\\nHuman:")."""


def _hh_text(chosen: str, rejected: str, c: ColumnsSpec) -> Example:
    """HH's two conversations in text: the prompt up to and including the last "\\n\\nAssistant:" (where the DPO paper
    cuts hh-rlhf), the same in both; the answers what follows it."""
    cuts = [text.rfind(_HH_ASSISTANT) for text in (chosen, rejected)]
    if -1 in cuts:
        raise RowProblem(c.chosen, f"and {c.rejected} are text without a {c.prompt} column, and not Anthropic HH "
                         "conversations (\"\\n\\nHuman: ... \\n\\nAssistant: ...\") to take the prompt from: give the "
                         f"prompt its own column ({c.prompt})", "not_a_conversation")
    prompt = chosen[: cuts[0] + len(_HH_ASSISTANT)]
    if rejected[: cuts[1] + len(_HH_ASSISTANT)] != prompt:
        raise RowProblem(c.chosen, f"and {c.rejected} differ before their last assistant turn (\"\\n\\nAssistant:\"): "
                         "without a prompt column, the prompt is all the two conversations share but their last "
                         "assistant turns; give the prompt its own column", "not_a_conversation")
    return _text_pair(prompt, chosen[len(prompt):], rejected[len(prompt):], c)


def _prompt_answer(question: str, context: str, answer: str, fields: tuple[str, str]) -> Example:
    """Question and context trimmed (the task's template places them); the answer as written, as every format keeps
    what carries loss (leading indentation is code)."""
    if not question.strip():
        raise RowProblem(fields[0], "is empty", "empty")
    if not answer.strip():
        raise RowProblem(fields[1], "is empty", "empty")
    return Example(question=question.strip(), context=context.strip(), answer=answer)


def _instruction(row: dict[str, Any], c: ColumnsSpec, roles: Roles = None) -> Example:
    ex = _prompt_answer(_string(row, c.instruction), _string(row, c.input, required=False),
                        _string(row, c.output), (c.instruction, c.output))
    return replace(ex, system=_string(row, SYSTEM, required=False))


def _question_answer(row: dict[str, Any], c: ColumnsSpec, roles: Roles = None) -> Example:
    ex = _prompt_answer(_string(row, c.question), _string(row, c.context, required=False),
                        _string(row, c.answer), (c.question, c.answer))
    db_id = row.get("db_id")
    return Example(ex.question, ex.context, ex.answer, str(db_id) if db_id is not None else "")


def _text(row: dict[str, Any], c: ColumnsSpec, roles: Roles = None) -> Example:
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
    Format("preference", ("chosen", "rejected"), ("prompt", "conversations", "messages"),
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


DETECTION_ORDER = ("preference", *(name for name in FORMATS if name != "preference"))
"""The order in which `data.format: auto` tries the formats: preference rows first, since `chosen` and `rejected` are
no other format's columns and their prompt may be any other's (`conversations`, `messages`, `prompt`)."""


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
    for fmt in (FORMATS[name] for name in DETECTION_ORDER):
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
