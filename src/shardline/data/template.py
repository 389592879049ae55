"""Prompt templates: one example → prompt token ids (no loss) and answer token ids + its end (loss).

The words of a prompt are the task's (`PromptTemplate`, `shardline.tasks`); how they become tokens is here.
Prompt and answer are tokenized separately so the boundary is exact and inference sees the same
prompt tokens as training. The answer ends with what makes the model stop: EOS for the plain template; for
`chat`, the end-of-turn the tokenizer's own chat template writes after an assistant message (`<|im_end|>`
for ChatML, `<|eot_id|>` for Llama 3), which need not be the tokenizer's EOS.

The chat template renders through `shardline.data.chat_template`, within bounds: it comes with a model from outside.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from shardline.data.chat_template import chat_ids, chat_text
from shardline.spec import PromptFormat


@dataclass(frozen=True)
class PromptTemplate:
    """How a task turns an example's question and context into prompt text."""

    plain: Callable[[str, str], str]
    """(question, context) → the whole prompt of `data.prompt_format: plain`; the answer follows it directly."""
    chat: Callable[[str, str], str]
    """(question, context) → the user message of `data.prompt_format: chat` (the tokenizer's template wraps it)."""
    version: str
    """Changes whenever the text does: part of the dataset version, so a new text is prepared anew."""


def encode_prompt(tok: PreTrainedTokenizerBase, template: PromptTemplate, question: str, context: str,
                  fmt: PromptFormat, literal: str | None = None) -> list[int]:
    """Prompt ids: the task's template around question and context, or the row's own prompt text (`literal`)."""
    if fmt == "chat":
        user = literal if literal is not None else template.chat(question, context)
        return chat_ids(tok, [{"role": "user", "content": user}], add_generation_prompt=True)
    # Exactly one BOS, added here, never again by the tokenizer.
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    return bos + tok.encode(literal if literal is not None else template.plain(question, context),
                            add_special_tokens=False)


def encode_answer(tok: PreTrainedTokenizerBase, answer: str, fmt: PromptFormat = "plain") -> list[int]:
    """Answer tokens followed by the answer's end (`answer_end`), so the model learns to stop."""
    return tok.encode(answer, add_special_tokens=False) + answer_end(tok, fmt)


_PROBE = "\x1fshardline-answer\x1f"


def answer_end(tok: PreTrainedTokenizerBase, fmt: PromptFormat) -> list[int]:
    """The token ids that close an answer: EOS (plain), or the chat template's end of an assistant turn."""
    if fmt != "chat":
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
