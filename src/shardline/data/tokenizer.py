"""Tokenizers: a byte-level BPE trained on the training split (embedded default) or a model's own."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from shardline.errors import DataError

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def train_bpe(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style) with distinct BOS, EOS and PAD tokens."""
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
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """A model's own tokenizer from a local directory (or the HF cache/hub when online)."""
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
