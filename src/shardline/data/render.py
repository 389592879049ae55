"""One example → its token ids and which of them carry loss, for every kind of example.

- prompt and answer: the prompt (the task's template around question and context, or the row's own prompt) carries
  no loss; the answer and its end (EOS, or the chat template's end of turn) do (`shardline.data.template`);
- chat: the ids are exactly `tokenizer.apply_chat_template(messages)`'s, so training sees what inference will; the
  loss covers each trained assistant turn's content and its end-of-turn tokens, found by rendering the conversation
  up to the turn (with the generation prompt) and through it: the turn is what lies between;
- text: BOS, the document, EOS; every token but the first carries loss (the first has nothing to be predicted from).

`loss[t] = 1` means token t is a target, predicted from the tokens before it.

What one example costs is bounded, whatever its length: a text longer than `TEXT_WINDOW` characters is tokenized a
window at a time (`text_ids`), and an example that certainly has more tokens than a row holds is found by counting
its tokens a window at a time (`certainly_longer`), never by tokenizing it whole with offsets (~200 bytes a
character: a row of 10 MB took 2 GB).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from shardline.data.chat_template import chat_ids, chat_text
from shardline.data.template import (
    bos_ids,
    check_tools_rendered,
    encode_answer,
    encode_prompt,
    resolved_format,
    stop_ids,
)
from shardline.data.tokenizer import TEXT_WINDOW, windows
from shardline.errors import DataError
from shardline.example import Example, trained_turns
from shardline.spec import PromptFormat
from shardline.tasks.base import PromptTemplate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Rendered:
    ids: list[int]
    loss: list[int]


def check_chat_template(tok: PreTrainedTokenizerBase, where: str, why: str) -> None:
    if not getattr(tok, "chat_template", None):
        raise DataError(where, f"the tokenizer has no chat template, and {why} renders with it",
                        "use a chat/instruct model's tokenizer (model.path or model.tokenizer), or a format without "
                        "a template: data.prompt_format=plain, or rows of prompt/completion, instruction or text")


def render(tok: PreTrainedTokenizerBase, ex: Example, template: PromptTemplate, fmt: PromptFormat,
           assistant_turns: str = "all") -> Rendered:
    return render_many(tok, [ex], template, fmt, assistant_turns)[0]  # type: ignore[return-value]


def render_many(tok: PreTrainedTokenizerBase, examples: list[Example], template: PromptTemplate, fmt: PromptFormat,
                assistant_turns: str = "all", max_tokens: int | None = None) -> list[Rendered | None]:
    """`render` of each example; the conversations' texts are tokenized in one batch call. With `max_tokens`, an
    example (not a text) that certainly renders to more tokens is None, found without tokenizing it whole."""
    fmt = resolved_format(tok, fmt)
    out: list[Rendered | None] = [None] * len(examples)
    chats: list[tuple[int, str, list[tuple[int, int]]]] = []
    for k, ex in enumerate(examples):
        if ex.kind == "chat":
            check_tools_rendered(tok, ex)
            text, spans = chat_spans(tok, ex.messages, ex.trained_from, assistant_turns, ex.tools)
            if max_tokens is None or not certainly_longer(tok, [text], max_tokens):
                chats.append((k, text, spans))
        elif ex.kind == "text":
            ids = text_ids(tok, ex.text or "").tolist()
            out[k] = Rendered(ids, [0] + [1] * (len(ids) - 1))
        elif max_tokens is None or not certainly_longer(tok, [_prompt_text(ex, template, fmt), ex.answer],
                                                        max_tokens):
            prompt = encode_prompt(tok, template, ex.question, ex.context, fmt, literal=ex.prompt, system=ex.system)
            answer = encode_answer(tok, ex.answer, fmt)
            out[k] = Rendered(prompt + answer, [0] * len(prompt) + [1] * len(answer))
    for (k, _, _), rendered in zip(chats, _with_loss(tok, [(text, spans) for _, text, spans in chats]), strict=True):
        out[k] = rendered
    return out


def _prompt_text(ex: Example, template: PromptTemplate, fmt: PromptFormat) -> str:
    """The text a prompt's ids are the tokens of (less a template's wrapping)."""
    if ex.prompt is not None:
        return ex.prompt
    return (template.chat if fmt == "chat" else template.plain)(ex.question, ex.context)


WINDOW_SLACK = 4
"""Tokens by which a window tokenized alone may differ from the same characters tokenized within their text (a
tokenizer that marks a text's start, a window cut inside a word): `certainly_longer` counts this against each."""


def text_ids(tok: PreTrainedTokenizerBase, text: str) -> np.ndarray:
    """BOS (where the tokenizer adds one: `bos_ids`), the text's tokens and EOS, as int32. A text longer than
    `TEXT_WINDOW` is tokenized window by window, each ending where pre-tokenization splits anyway (`windows`): its
    tokens are those of the whole for byte-level BPE (GPT-2, Llama 3, Qwen) and Metaspace (SentencePiece converted)
    tokenizers, but where a window had to be cut inside a word (no space or line break in `TEXT_WINDOW / 2`
    characters), or where a tokenizer marks the start of every text it is given (Llama 2's normalizer prepends `▁`):
    a token or two may differ there."""
    bos = bos_ids(tok)
    parts = [np.asarray(tok.encode(window, add_special_tokens=False), dtype=np.int32)
             for window in windows(text, TEXT_WINDOW)]
    return np.concatenate([np.asarray(bos, dtype=np.int32), *parts, np.asarray([tok.eos_token_id], dtype=np.int32)])


def certainly_longer(tok: PreTrainedTokenizerBase, texts: list[str], limit: int) -> bool:
    """Whether the texts together have more than `limit` tokens beyond doubt, counted window by window (windows that
    grow from 8 characters a token of `limit`, no more of them than it takes); False for texts shorter than a window
    together, which are cheap to tokenize."""
    if sum(len(text) for text in texts) <= TEXT_WINDOW:
        return False
    count = 0
    for text in texts:
        for window in windows(text, TEXT_WINDOW, first=max(4096, 8 * limit)):
            count += len(tok.encode(window, add_special_tokens=False)) - WINDOW_SLACK
            if count > limit:
                return True
    return False


def _with_loss(tok: PreTrainedTokenizerBase, texts: list[tuple[str, list[tuple[int, int]]]]) -> list[Rendered]:
    """Texts tokenized in one batch, a token carrying loss where its characters overlap a trained span."""
    out = []
    for (_, spans), (ids, offsets) in zip(texts, _encode_with_offsets(tok, [t for t, _ in texts]), strict=True):
        at = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
        loss = np.zeros(len(ids), dtype=bool)
        for start, end in spans:
            loss |= (at[:, 0] < end) & (at[:, 1] > start)
        out.append(Rendered(list(ids), loss.astype(np.uint8).tolist()))
    return out


def _encode_with_offsets(tok: PreTrainedTokenizerBase, texts: list[str]) -> list[tuple[list[int], list]]:
    """Token ids and character offsets of texts, as `tok(texts, add_special_tokens=False)` gives them; through the
    fast tokenizer's own batch call when there is one."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        return [(e.ids, e.offsets) for e in backend.encode_batch(texts, add_special_tokens=False)]
    encoded = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
    return list(zip(encoded["input_ids"], encoded["offset_mapping"], strict=True))


def render_chat(tok: PreTrainedTokenizerBase, messages: list[dict], trained_from: int = 0,
                assistant_turns: str = "all", tools: list[dict] | None = None) -> Rendered:
    return _with_loss(tok, [chat_spans(tok, messages, trained_from, assistant_turns, tools)])[0]


def _chat_text(tok: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool,
               tools: list[dict] | None = None) -> str:
    return chat_text(tok, messages, generation_prompt, tools)


def chat_spans(tok: PreTrainedTokenizerBase, messages: list[dict], trained_from: int = 0,
               assistant_turns: str = "all", tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text as the chat template renders it (offered `tools`), and the character spans that carry
    loss: all each trained assistant turn says (`trained_turns`: content, tool calls) and its end of turn."""
    text = _chat_text(tok, messages, False, tools)
    trained = trained_turns(messages, trained_from, assistant_turns)
    # A turn with more than a content (tool calls, reasoning) says more than its content: renderings of whole
    # prefixes find all of it, the marks only the content.
    plain = all(set(messages[i]) <= {"role", "content", "weight"} for i in trained)
    spans = _marked_spans(tok, messages, trained, text, tools) if plain else None
    return text, spans if spans is not None else _prefix_spans(tok, messages, trained, text, tools)


_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters: no template trims or rewrites them


def _marked_spans(tok: PreTrainedTokenizerBase, messages: list[dict], trained: list[int], text: str,
                  tools: list[dict] | None = None) -> list[tuple[int, int]] | None:
    """One more rendering, with each trained turn's content between marks: where the marks land is where the
    contents are, provided that the marks removed give back the text exactly and each content is followed by the
    template's end of turn; None otherwise (the template transforms contents: `_prefix_spans` then)."""
    if any(_OPEN in m["content"] or _CLOSE in m["content"] for m in messages):
        return None
    keep = set(trained)
    marked = _chat_text(tok, [dict(m, content=f"{_OPEN}{m['content']}{_CLOSE}") if i in keep else m
                              for i, m in enumerate(messages)], False, tools)
    if (marked.count(_OPEN), marked.count(_CLOSE)) != (len(trained), len(trained)) or \
            marked.replace(_OPEN, "").replace(_CLOSE, "") != text:
        return None
    tail = _turn_end(tok)
    spans, at = [], 0
    for k in range(len(trained)):  # the k-th content's marks sit after 2k earlier marks
        opening = marked.index(_OPEN, at)
        at = marked.index(_CLOSE, opening)
        start, end = opening - 2 * k, at - 2 * k - 1
        if not text.startswith(tail, end):
            return None
        spans.append((start, end + len(tail)))
    return spans


_PROBE = "\ue002"
_TURN_ENDS: dict[tuple[str, ...], str] = {}


def _turn_end(tok: PreTrainedTokenizerBase) -> str:
    """What the template writes after an assistant turn's content, up to its line break (ChatML: `<|im_end|>`)."""
    key = (tok.chat_template or "", str(tok.eos_token), str(tok.bos_token))  # what a template's text depends on
    if key not in _TURN_ENDS:
        text = _chat_text(tok, [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE}], False)
        _TURN_ENDS[key] = text[text.rindex(_PROBE) + 1:].rstrip()
    return _TURN_ENDS[key]


def _prefix_spans(tok: PreTrainedTokenizerBase, messages: list[dict], trained: list[int], text: str,
                  tools: list[dict] | None = None) -> list[tuple[int, int]]:
    """Each trained turn by rendering the conversation up to it (with the generation prompt) and through it: the
    turn is what lies between (two renderings per turn; for templates that transform contents). A template whose
    renderings of a conversation's beginning are not the beginning of its whole (Qwen3's drops the reasoning of
    assistant turns before the last question) has its turns located in the whole instead (`_located_spans`)."""
    spans = []
    for i in trained:
        before = _chat_text(tok, messages[:i], True, tools)
        through = _chat_text(tok, messages[: i + 1], False, tools).rstrip()  # the line break after a turn is not said
        if not (text.startswith(before) and text.startswith(through) and len(through) > len(before)):
            located = _located_spans(tok, messages, trained, text)
            if located is None:
                name = tok.name_or_path or "the tokenizer"
                raise DataError(f"{name}: its chat template", "does not render a conversation's first turns as the "
                                "beginning of the whole (it rewrites earlier turns), and its assistant turns cannot "
                                "be found in the whole by their header and end of turn",
                                "set data.assistant_turns=last, or name a template that renders turns in order "
                                "(data.chat_template=chatml, llama3 or alpaca)")
            return located
        spans.append((len(before), len(through)))
    return spans


def _located_spans(tok: PreTrainedTokenizerBase, messages: list[dict], trained: list[int], text: str
                   ) -> list[tuple[int, int]] | None:
    """The trained turns found in the rendering of the whole conversation: the k-th assistant turn is what follows
    the k-th assistant header (what the generation prompt adds, e.g. `<|im_start|>assistant\n`) through the first
    end of turn after it (`<|im_end|>`). The turns are trained as the whole renders them (Qwen3: earlier turns
    without their reasoning, as the model sees them later in a conversation). None where the header or the end of
    turn cannot be told (empty, or not one per assistant turn)."""
    probe = [{"role": "user", "content": "?"}]
    asked, said = _chat_text(tok, probe, True), _chat_text(tok, probe, False)
    header, tail = asked[len(said):], _turn_end(tok)
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not asked.startswith(said) or not header.strip() or not tail or text.count(header) != len(assistants):
        return None
    starts, at = [], 0
    for _ in assistants:
        at = text.index(header, at) + len(header)
        starts.append(at)
    spans = []
    for i in trained:
        k = assistants.index(i)
        start = starts[k]
        end = text.find(tail, start)
        if end < 0 or (k + 1 < len(starts) and end + len(tail) > starts[k + 1] - len(header)):
            return None
        spans.append((start, end + len(tail)))
    return spans


def generation_prompt(tok: PreTrainedTokenizerBase, ex: Example, template: PromptTemplate, fmt: PromptFormat
                      ) -> tuple[list[int], str, list[int]] | None:
    """What a model is asked and should answer for `ex`: the prompt ids (a conversation up to its last assistant
    turn, with the template's generation prompt), the reference answer, and the ids generation stops at; None for a
    text, which asks nothing."""
    if ex.kind == "text":
        return None
    if ex.kind == "chat":
        last = max(i for i, m in enumerate(ex.messages) if m["role"] == "assistant")
        ids = chat_ids(tok, ex.messages[:last], add_generation_prompt=True, tools=ex.tools)
        return ids, ex.messages[last]["content"], stop_ids(tok, "chat")
    prompt = encode_prompt(tok, template, ex.question, ex.context, fmt, ex.prompt, ex.system)
    return prompt, ex.answer, stop_ids(tok, fmt)
