"""What is trained on: examples rendered as preparation renders them, before packing, with the tokens that carry loss
marked (`shardline prepare --show N`, `--json FILE`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardline.data.render import render_many
from shardline.example import Example
from shardline.spec import JobSpec
from shardline.tasks import get_task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def rendered(tok: PreTrainedTokenizerBase, examples: list[tuple[str, Example]], spec: JobSpec) -> list[dict]:
    """Per example (split, example), before packing: its split, source, text, token ids and loss flags; a preference
    pair of a DPO run as its two documents, each marked `pair: chosen | rejected` (SFT trains the chosen alone). An
    example preparation drops (longer than `train.seq_len`; a pair whose documents do not fit one row together) is
    marked `dropped` (the reason, as the prepare summary counts it) with `why`, and no token carries loss; one far
    longer is never tokenized whole (no tokens, its text cut)."""
    template = get_task(spec.data.task).prompt
    seq_len = spec.train.seq_len
    out = []
    for split, ex in examples:
        pairs = ex.preference and spec.train.objective == "dpo"
        docs = ex.chosen_and_rejected() if pairs else ex.chosen_and_rejected()[:1] if ex.preference else (ex,)
        renders = render_many(tok, list(docs), template, spec.data.prompt_format, spec.data.assistant_turns,
                              max_tokens=seq_len)
        why = _too_long(renders, seq_len) if ex.kind != "text" or pairs else None  # a text is cut, never dropped
        for doc, r, pair in zip(docs, renders, ("chosen", "rejected") if pairs else (None,), strict=False):
            item = {"split": split, "source": ex.source or "generated"}
            if r is None:
                item |= {"text": _head(doc), "tokens": [], "loss": []}
            else:
                item |= {"text": tok.decode(r.ids), "tokens": r.ids, "loss": [0] * len(r.ids) if why else r.loss}
            out.append(item | ({"pair": pair} if pair else {}) | ({"dropped": "too_long", "why": why} if why else {}))
    return out


def _too_long(renders: list, seq_len: int) -> str | None:
    """Why an example's documents are dropped as too long for a row (None: they fit)."""
    if None in renders:
        return f"far longer than train.seq_len={seq_len} tokens (not tokenized whole)"
    n = sum(len(r.ids) for r in renders)
    if n <= seq_len:
        return None
    return f"{n} tokens{' together' if len(renders) > 1 else ''}, more than train.seq_len={seq_len}"


HEAD_CHARS = 2000
"""What is shown of an example too long to tokenize."""


def _head(ex: Example) -> str:
    text = ex.text or ex.prompt or ex.question or next((m.get("content") or "" for m in ex.messages), "")
    text = str(text)
    return text[:HEAD_CHARS] + (" …" if len(text) > HEAD_CHARS else "")


LOSS_OPEN, LOSS_CLOSE = "⟦", "⟧"


def marked_text(tok: PreTrainedTokenizerBase, ids: list[int], loss: list[int]) -> list[tuple[str, bool]]:
    """The decoded text in runs of tokens that carry loss (True) or not (False)."""
    runs: list[tuple[str, bool]] = []
    start = 0
    for t in range(1, len(ids) + 1):
        if t == len(ids) or loss[t] != loss[start]:
            runs.append((tok.decode(ids[start:t]), bool(loss[start])))
            start = t
    return runs
