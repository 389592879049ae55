"""One example → its token ids and which of them carry loss, for every kind of example.

- prompt and answer: the prompt (the task's template around question and context, or the row's own prompt) carries
  no loss; the answer and its end (EOS, or the chat template's end of turn) do (`shardline.data.template`);
- chat: the ids are exactly `tokenizer.apply_chat_template(messages)`'s, so training sees what inference will; the
  loss covers each trained assistant turn's content and its end-of-turn tokens, found by rendering the conversation
  up to the turn (with the generation prompt) and through it: the turn is what lies between;
- text: BOS, the document, EOS; every token but the first carries loss (the first has nothing to be predicted from).

`loss[t] = 1` means token t is a target, predicted from the tokens before it.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from shardline.data.example import Example
from shardline.data.template import PromptTemplate, encode_answer, encode_prompt, stop_ids
from shardline.errors import DataError
from shardline.spec import PromptFormat


@dataclass(frozen=True)
class Rendered:
    ids: list[int]
    loss: list[int]


def needs_chat_template(ex: Example, fmt: PromptFormat) -> bool:
    return ex.kind == "chat" or (ex.kind == "prompt_answer" and fmt == "chat")


def check_chat_template(tok: PreTrainedTokenizerBase, where: str, why: str) -> None:
    if not getattr(tok, "chat_template", None):
        raise DataError(where, f"the tokenizer has no chat template, and {why} renders with it",
                        "use a chat/instruct model's tokenizer (model.path or model.tokenizer), or a format without "
                        "a template: data.prompt_format=plain, or rows of prompt/completion, instruction or text")


def render(tok: PreTrainedTokenizerBase, ex: Example, template: PromptTemplate, fmt: PromptFormat,
           assistant_turns: str = "all") -> Rendered:
    if ex.kind == "chat":
        return render_chat(tok, ex.messages, ex.trained_from, assistant_turns)
    if ex.kind == "text":
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        ids = bos + tok.encode(ex.text, add_special_tokens=False) + [tok.eos_token_id]
        return Rendered(ids, [0] + [1] * (len(ids) - 1))
    prompt = encode_prompt(tok, template, ex.question, ex.context, fmt, literal=ex.prompt)
    answer = encode_answer(tok, ex.answer, fmt)
    return Rendered(prompt + answer, [0] * len(prompt) + [1] * len(answer))


def _chat_text(tok: PreTrainedTokenizerBase, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def render_chat(tok: PreTrainedTokenizerBase, messages: list[dict[str, str]], trained_from: int = 0,
                assistant_turns: str = "all") -> Rendered:
    text = _chat_text(tok, messages, False)
    encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    trained = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= trained_from]
    if assistant_turns == "last":
        trained = trained[-1:]
    spans = []
    for i in trained:
        before = _chat_text(tok, messages[:i], True)
        through = _chat_text(tok, messages[: i + 1], False).rstrip()  # the line break after a turn is not said
        if not (text.startswith(before) and text.startswith(through) and len(through) > len(before)):
            raise DataError("model.tokenizer", "its chat template does not render a conversation's first turns as "
                            "the beginning of the whole (it rewrites earlier turns), so the assistant turns cannot "
                            "be located", "set data.assistant_turns=last, or use a template that renders turns "
                            "in order")
        spans.append((len(before), len(through)))
    loss = [int(any(a < end and b > start for start, end in spans)) for a, b in encoded["offset_mapping"]]
    return Rendered(list(encoded["input_ids"]), loss)


def generation_prompt(tok: PreTrainedTokenizerBase, ex: Example, template: PromptTemplate, fmt: PromptFormat
                      ) -> tuple[list[int], str, list[int]] | None:
    """What a model is asked and should answer for `ex`: the prompt ids (a conversation up to its last assistant
    turn, with the template's generation prompt), the reference answer, and the ids generation stops at; None for a
    text, which asks nothing."""
    if ex.kind == "text":
        return None
    if ex.kind == "chat":
        last = max(i for i, m in enumerate(ex.messages) if m["role"] == "assistant")
        ids = tok.apply_chat_template(ex.messages[:last], add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        return list(ids), ex.messages[last]["content"], stop_ids(tok, "chat")
    return encode_prompt(tok, template, ex.question, ex.context, fmt, ex.prompt), ex.answer, stop_ids(tok, fmt)
