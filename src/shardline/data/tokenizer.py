"""Tokenizers: a byte-level BPE trained on the training split (embedded default) or a model's own."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from shardline.errors import DataError

if TYPE_CHECKING:  # transformers (and torch under it) is imported where a tokenizer is made, not by importing this
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
TEXT_WINDOW = 1 << 18
"""Characters tokenized at once: a longer text is tokenized window by window (`windows`), a shorter one whole, as
always (a quarter of a million characters: nearly every document, and ~50 MB of a tokenizer's working memory)."""


def train_bpe(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style) with distinct BOS, EOS and PAD tokens. A text longer than `TEXT_WINDOW` is
    learnt from window by window (`windows`): the same words, in a bounded memory (whole, a text of 10 MB took the
    trainer 1 GB)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((window for text in texts for window in windows(text, TEXT_WINDOW)), trainer)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def windows(text: str, size: int, first: int | None = None) -> Iterator[str]:
    """`text` in consecutive pieces of at most `size` characters (`first` for the first, each next one twice the last
    up to `size`), each ending in its second half before a space between two words (where byte-level BPE and
    Metaspace tokenizers start a token), else after a line break between two lines (where byte-level BPE does), else
    at its size."""
    start, width = 0, min(size, first or size)
    while len(text) - start > width:
        end = _window_end(text, start + width // 2, start + width)
        yield text[start:end]
        start, width = end, min(size, 2 * width)
    yield text[start:]


def _window_end(text: str, lo: int, hi: int) -> int:
    at = text.rfind(" ", lo, hi + 1)
    while at > lo:
        if not text[at - 1].isspace() and at + 1 < len(text) and not text[at + 1].isspace():
            return at
        at = text.rfind(" ", lo, at)
    at = text.rfind("\n", lo, hi)
    while at > lo:
        if not text[at - 1].isspace() and not text[at + 1].isspace():
            return at + 1
        at = text.rfind("\n", lo, at)
    return hi


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """A model's own tokenizer from a local directory (or the HF cache/hub when online)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as e:
        raise DataError(
            name_or_path, f"cannot load a tokenizer ({e.__class__.__name__}: {str(e)[:200]})",
            "point model.tokenizer (or model.path) at a directory with tokenizer.json/tokenizer_config.json",
        ) from e
    if tok.eos_token_id is None:
        raise DataError(name_or_path, "the tokenizer has no EOS token", "use a tokenizer that defines eos_token")
    return tok


def tokenizer_fingerprint(name_or_path: str) -> str:
    """Content hash of a local tokenizer directory, or the name of a hub tokenizer."""
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        return f"hub:{name_or_path}"
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        f = path / name
        if f.is_file():
            digest.update(name.encode() + f.read_bytes())
    return digest.hexdigest()


def special_ids(tok: PreTrainedTokenizerBase, pad: int) -> dict[str, int]:
    """The token ids a model is built with (config bos/eos/pad)."""
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": pad}


def pad_id(tok: PreTrainedTokenizerBase) -> int:
    """A padding id distinct from EOS: padding is excluded by masks, EOS must keep its loss."""
    if tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id:
        return int(tok.pad_token_id)
    return 0 if tok.eos_token_id != 0 else 1
