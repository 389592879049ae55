"""A small chat tokenizer the data tests render with: a byte-level BPE trained on the rows, ChatML's special
tokens, and the template given, saved as a model's tokenizer directory."""

from __future__ import annotations

from pathlib import Path

from shardline.data.tokenizer import train_bpe


def chatml_tokenizer(texts: list[str], vocab: int, template: str, directory: Path) -> Path:
    tok = train_bpe(texts, vocab)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = template
    tok.save_pretrained(directory)
    return directory
