"""Prompt templates: one example → prompt token ids (no loss) and answer token ids + its end (loss).

The words of a prompt are the task's (`shardline.tasks.base.PromptTemplate`); how they become tokens is here.
Prompt and answer are tokenized separately so the boundary is exact and inference sees the same
prompt tokens as training. The answer ends with what makes the model stop: EOS for the plain template; for
`chat`, the end-of-turn the tokenizer's own chat template writes after an assistant message (`<|im_end|>`
for ChatML, `<|eot_id|>` for Llama 3), which need not be the tokenizer's EOS.

The chat template renders through `shardline.data.chat_template`, within bounds: it comes with a model from outside.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardline.data.chat_template import chat_ids, chat_text
from shardline.data.tokenizer import BOS
from shardline.errors import DataError
from shardline.example import Example
from shardline.spec import PromptFormat
from shardline.tasks.base import PromptTemplate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def resolved_format(tok: PreTrainedTokenizerBase, fmt: PromptFormat) -> PromptFormat:
    """`plain` or `chat`: `auto` is chat when the tokenizer has a chat template, else plain."""
    if fmt == "auto":
        return "chat" if getattr(tok, "chat_template", None) else "plain"
    return fmt


_ADDS_BOS: dict[tuple[str, ...], bool] = {}
"""Whether a tokenizer adds BOS itself, by tokenizer (asked once: a prompt is encoded per example)."""


def bos_ids(tok: PreTrainedTokenizerBase) -> list[int]:
    """The BOS a plain prompt or a text starts with: the tokenizer's, where it adds one itself (`tok(text)`: Llama,
    Mistral, Gemma), and for shardline's own BPE (`BOS`); none where it adds none (Qwen, GPT-2), as its model was
    trained and as `transformers` and TRL tokenize."""
    if tok.bos_token_id is None:
        return []
    if tok.bos_token == BOS:
        return [tok.bos_token_id]
    key = (str(id(tok)), tok.name_or_path or "", str(tok.bos_token), str(len(tok)))
    if key not in _ADDS_BOS:
        ids = tok("a", add_special_tokens=True)["input_ids"]
        _ADDS_BOS[key] = bool(ids) and ids[0] == tok.bos_token_id
    return [tok.bos_token_id] if _ADDS_BOS[key] else []


def encode_prompt(tok: PreTrainedTokenizerBase, template: PromptTemplate, question: str, context: str,
                  fmt: PromptFormat, literal: str | None = None, system: str = "") -> list[int]:
    """Prompt ids: the task's template around question and context, or the row's own prompt text (`literal`); a
    row's `system` prompt before it: a system turn (chat), or its text and a blank line (plain)."""
    if resolved_format(tok, fmt) == "chat":
        user = literal if literal is not None else template.chat(question, context)
        turns = [{"role": "system", "content": system}] if system else []
        return chat_ids(tok, [*turns, {"role": "user", "content": user}], add_generation_prompt=True)
    # At most one BOS (`bos_ids`), added here, never again by the tokenizer.
    text = literal if literal is not None else template.plain(question, context)
    return bos_ids(tok) + tok.encode(f"{system}\n\n{text}" if system else text, add_special_tokens=False)


def encode_answer(tok: PreTrainedTokenizerBase, answer: str, fmt: PromptFormat = "plain") -> list[int]:
    """Answer tokens followed by the answer's end (`answer_end`), so the model learns to stop."""
    return tok.encode(answer, add_special_tokens=False) + answer_end(tok, fmt)


_PROBE = "\x1fshardline-answer\x1f"


def answer_end(tok: PreTrainedTokenizerBase, fmt: PromptFormat) -> list[int]:
    """The token ids that close an answer: EOS (plain), or the chat template's end of an assistant turn."""
    if resolved_format(tok, fmt) != "chat":
        return [tok.eos_token_id]
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE}]
    text = chat_text(tok, messages)
    # What follows the content up to the line break (ChatML: "<|im_end|>\n"; the break is not the model's to say).
    tail = text[text.rindex(_PROBE) + len(_PROBE):].rstrip()
    ids = tok.encode(tail, add_special_tokens=False) if tail else []
    return ids or [tok.eos_token_id]


def stop_ids(tok: PreTrainedTokenizerBase, fmt: PromptFormat) -> list[int]:
    """Generation stops at EOS or at the last token of the answer's end."""
    return sorted({tok.eos_token_id, answer_end(tok, fmt)[-1]})


# A tool-using conversation whose every part carries a value found nowhere else: what a template renders of it shows
# what it can render. The call id is nine letters and digits (Mistral's templates refuse others).
_TOOL_PROBE_ID = "shardl1ne"
_TOOL_PROBE = [
    {"role": "user", "content": "?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": _TOOL_PROBE_ID, "type": "function", "function": {
        "name": "shardline_probe", "arguments": {"value": "shardline-probe-argument"}}}]},
    {"role": "tool", "tool_call_id": _TOOL_PROBE_ID, "name": "shardline_probe", "content": "shardline-probe-result"},
    {"role": "assistant", "content": "."}]
_TOOL_PROBE_TOOLS = [{"type": "function", "function": {"name": "shardline_probe",
                                                       "description": "shardline-probe-description",
                                                       "parameters": {"type": "object", "properties": {}}}}]
_TOOL_PARTS = {"tool calls": "shardline-probe-argument", "tool results": "shardline-probe-result",
               "tool definitions (the row's `tools`)": "shardline-probe-description"}
_TOOL_SUPPORT: dict[tuple[str, ...], dict[str, bool] | str] = {}


def _tool_support(tok: PreTrainedTokenizerBase) -> dict[str, bool] | str:
    """Which parts of a tool-using conversation the chat template renders (`_TOOL_PARTS`), or what it raised."""
    key = (tok.chat_template or "", str(tok.eos_token), str(tok.bos_token))
    if key not in _TOOL_SUPPORT:
        try:
            text = tok.apply_chat_template(_TOOL_PROBE, tools=_TOOL_PROBE_TOOLS, tokenize=False)
            _TOOL_SUPPORT[key] = {part: value in text for part, value in _TOOL_PARTS.items()}
        except Exception as e:  # noqa: BLE001 - a template from outside may raise anything on tool turns
            _TOOL_SUPPORT[key] = f"raises {type(e).__name__}: {e}"
    return _TOOL_SUPPORT[key]


def tool_parts(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[str]:
    """The parts of tool use (`_TOOL_PARTS`) a conversation has."""
    has = {"tool calls": any(m.get("tool_calls") for m in messages),
           "tool results": any(m["role"] == "tool" for m in messages),
           "tool definitions (the row's `tools`)": bool(tools)}
    return [part for part in _TOOL_PARTS if has[part]]


def check_tools_rendered(tok: PreTrainedTokenizerBase, ex: Example) -> None:
    """A DataError unless the chat template renders every part of tool use the conversation has: a template that
    drops an assistant's tool calls would train the model to answer a tool request with an empty turn."""
    parts = tool_parts(ex.messages, ex.tools)
    if not parts:
        return
    support = _tool_support(tok)
    missing = parts if isinstance(support, str) else [part for part in parts if not support[part]]
    if not missing:
        return
    why = support if isinstance(support, str) else f"leaves out {' and '.join(missing)}"
    source = f"source {ex.source}" if ex.source else "the data"
    raise DataError(f"{tok.name_or_path or 'the tokenizer'}: its chat template",
                    f"{why} when it renders a tool-using conversation, and {source} has conversations with "
                    f"{', '.join(parts)}: a tool call rendered as nothing would train an empty turn",
                    "use the model's own template if it renders tool calls (Qwen2.5 and later, Llama 3.1 and later, "
                    "Mistral), set model.tokenizer to a tokenizer whose template does, or leave the tool rows out")
