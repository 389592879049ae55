"""Checks that fail a bad spec before a run directory exists: the model's location, the data's format and first rows,
and a chat template the rows need (each the error preparation would meet later, found in seconds)."""

from __future__ import annotations

import re
from pathlib import Path

from shardline.data.sources import head_examples
from shardline.errors import DataError, SpecError
from shardline.example import needs_chat_template
from shardline.spec import JobSpec

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""A hub repository id (`org/name`); anything else in model.path must be a local directory."""
PREFLIGHT_ROWS = 200


def check_model_location(spec: JobSpec) -> None:
    for field, value in (("model.path", spec.model.path), ("model.tokenizer", spec.model.tokenizer)):
        if value and "://" not in value and not Path(value).expanduser().exists() and not HUB_ID.fullmatch(value):
            raise SpecError(field, f"{value} does not exist (and is not a hub id such as org/name)",
                            f"point {field} at a local model directory (config.json, weights, tokenizer files) or "
                            "a hub repository id")


def preflight(spec: JobSpec) -> None:
    """What preparing the data would fail on, found in seconds: the model's location, the data's format and its
    first rows, and a chat template the rows need."""
    check_model_location(spec)
    examples = head_examples(spec.data, PREFLIGHT_ROWS)
    if not any(needs_chat_template(ex, spec.data.prompt_format) for ex in examples):
        return
    why = "a conversation" if examples[0].kind == "chat" else "data.prompt_format=chat"
    source = spec.model.tokenizer or spec.model.path
    if not source and spec.data.chat_template is None:  # the tokenizer trained on the data has no chat template
        raise DataError("model.path", f"is unset, so shardline trains a byte-level BPE on the data, which has no chat "
                        f"template, and {why} renders with one", "set model.path (or model.tokenizer) to a chat/"
                        "instruct model's directory, or use a format without a template")
    if not source:
        return  # the BPE is trained on the data when it is prepared, and given data.chat_template then
    # transformers (and torch under it) only where a template is checked: the launcher of a plain run never pays it
    from shardline.data.named_templates import use_named_template
    from shardline.data.render import check_chat_template, render_many
    from shardline.data.tokenizer import load_tokenizer
    from shardline.tasks import get_task

    tok = use_named_template(load_tokenizer(source), spec.data.chat_template)
    check_chat_template(tok, "model.tokenizer" if spec.model.tokenizer else "model.path", why)
    template = get_task(spec.data.task).prompt
    # A template that cannot render these rows fails here, by name (one far longer than a row is not tokenized).
    render_many(tok, examples[:8], template, spec.data.prompt_format, spec.data.assistant_turns,
                max_tokens=spec.train.seq_len)
