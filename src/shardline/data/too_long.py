"""Examples too long for a row: how long they are, and the warning when many are dropped.

An example longer than `train.seq_len` is dropped and counted (`<split>:too_long`); a few are expected, many mean a
`seq_len` too short for the data. The lengths are measured again on a sample, only when the warning is due: the
prepared chunks keep the lengths of the examples they kept, not of those they dropped (some never tokenized whole).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from shardline.data.encode import examples_in_order
from shardline.data.render import render_many
from shardline.data.sources import Source
from shardline.data.splits import Assignment
from shardline.example import Example
from shardline.spec import JobSpec
from shardline.tasks import get_task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

TOO_LONG_WARNING, KEEP_SHARE, LENGTH_SAMPLE = 0.10, 0.95, 2000
"""Above this share of examples dropped as too long, prepare warns and names the `train.seq_len` that keeps
`KEEP_SHARE` of them, measured on the first `LENGTH_SAMPLE` examples of each source."""


def say_too_long(spec: JobSpec, sources: list[Source], assignments: list[Assignment], formats: list[str],
                 tok: PreTrainedTokenizerBase, stats: dict) -> None:
    """A warning when more than `TOO_LONG_WARNING` of the examples (`stats`' splits) were dropped as too long: how
    many, and the `train.seq_len` that would keep `KEEP_SHARE` of them."""
    dropped = sum(n for reason, n in stats["dropped"].items() if reason.endswith(":too_long"))
    examples = sum(s.get("examples", 0) for s in stats["splits"].values())
    if not examples or dropped <= TOO_LONG_WARNING * examples:
        return
    lengths = example_lengths(spec, sources, assignments, formats, tok)
    if not lengths:
        return
    seq_len = spec.train.seq_len
    needed = sorted(lengths)[max(0, math.ceil(len(lengths) * KEEP_SHARE) - 1)]
    keeps = (f"train.seq_len={-(-needed // 64) * 64} keeps {KEEP_SHARE:.0%} of them" if needed != float("inf")
             else f"{KEEP_SHARE:.0%} of them need more than {LENGTH_CAP * seq_len:,} tokens")
    log.warning("%s of the examples (%s of %s) have more tokens than train.seq_len=%s and were dropped as too_long: "
                "%s (measured on %s of them). Raise train.seq_len (memory grows with it), or shorten the rows",
                f"{dropped / examples:.0%}", f"{dropped:,}", f"{examples:,}", seq_len, keeps, f"{len(lengths):,}")


LENGTH_CAP = 16
"""Examples are measured up to this many times `train.seq_len` tokens (a longer one is not tokenized whole)."""


def example_lengths(spec: JobSpec, sources: list[Source], assignments: list[Assignment], formats: list[str],
                    tok: PreTrainedTokenizerBase) -> list[float]:
    """Tokens of the first `LENGTH_SAMPLE` examples (not texts, which are cut, never dropped) of each source as they
    train (a pair under DPO: both documents), `inf` for one longer than `LENGTH_CAP` × seq_len."""
    template = get_task(spec.data.task).prompt
    pairs = spec.train.objective == "dpo"
    cap = LENGTH_CAP * spec.train.seq_len
    lengths: list[float] = []
    for source, a, fmt in zip(sources, assignments, formats, strict=True):
        docs: list[list[Example]] = []
        for _, ex, _ in examples_in_order(source, a):
            if ex.kind == "text":
                continue
            docs.append(list(ex.chosen_and_rejected()) if pairs and ex.preference else
                        [ex.chosen_and_rejected()[0] if ex.preference else ex])
            if len(docs) == LENGTH_SAMPLE:
                break
        rendered = iter(render_many(tok, [d for doc in docs for d in doc], template, fmt,  # type: ignore[arg-type]
                                    spec.data.assistant_turns, max_tokens=cap))
        for doc in docs:
            parts = [next(rendered) for _ in doc]
            lengths.append(float("inf") if any(r is None for r in parts) else sum(len(r.ids) for r in parts))
    return lengths
