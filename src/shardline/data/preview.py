"""What is trained on: examples rendered as preparation renders them, before packing, with the tokens that carry loss
marked (`shardline prepare --show N`, `--json FILE`)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from shardline.data.example import Example
from shardline.data.render import render_many
from shardline.spec import JobSpec
from shardline.tasks import get_task


def rendered(tok: PreTrainedTokenizerBase, examples: list[tuple[str, Example]], spec: JobSpec) -> list[dict]:
    """Per example (split, example), before packing: its split, source, text, token ids and loss flags; a preference
    pair of a DPO run as its two documents, each marked `pair: chosen | rejected` (SFT trains the chosen alone). An
    example far longer than `train.seq_len` (dropped as too long, not trained on) is left out, never tokenized whole."""
    template = get_task(spec.data.task).prompt
    out = []
    for split, ex in examples:
        pairs = ex.preference and spec.train.objective == "dpo"
        docs = ex.chosen_and_rejected() if pairs else ex.chosen_and_rejected()[:1] if ex.preference else (ex,)
        renders = render_many(tok, list(docs), template, spec.data.prompt_format, spec.data.assistant_turns,
                              max_tokens=spec.train.seq_len)
        if None in renders:
            continue
        for r, pair in zip(renders, ("chosen", "rejected") if pairs else (None,), strict=False):
            out.append({"split": split, "source": ex.source or "generated", "text": tok.decode(r.ids),
                        "tokens": r.ids, "loss": r.loss, **({"pair": pair} if pair else {})})
    return out


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
