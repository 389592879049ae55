"""A prepared-data cache may be written by others (a shared cache_dir): a run uses it only when every file's content
matches the checksums its meta.json lists; otherwise it is prepared again, as a damaged cache always was."""

import json

import numpy as np
import pytest

from shardline.data import prepare as prepare_mod
from shardline.data.prepare import prepare
from tests.conftest import small_spec


def _same_size_other_tokens(root):
    path = root / "train.tokens.npy"
    raw = bytearray(path.read_bytes())
    raw[-64:] = bytes(b ^ 0x01 for b in raw[-64:])  # the last tokens changed: the file keeps its size
    path.write_bytes(bytes(raw))


def _same_size_other_chat_template(root):
    path = root / "tokenizer" / "tokenizer_config.json"
    text = path.read_text()
    assert "<|eos|>" in text
    path.write_text(text.replace("<|eos|>", "<|EOS|>", 1))


def _checksums_removed(root):  # a meta.json of an older shardline, or one rewritten to skip the check
    meta = json.loads((root / "meta.json").read_text())
    meta.pop("sha256", None)
    (root / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("tamper", [_same_size_other_tokens, _same_size_other_chat_template, _checksums_removed])
def test_a_cache_whose_content_differs_from_its_manifest_is_prepared_again(tmp_path, tamper, caplog):
    spec = small_spec(tmp_path, shared_cache=False)
    first = prepare(spec)
    tokens = np.load(first.root / "train.tokens.npy").copy()
    config = (first.root / "tokenizer" / "tokenizer_config.json").read_text()
    tamper(first.root)
    assert prepare_mod.incomplete(first.root, first.version) is not None
    with caplog.at_level("WARNING", logger="shardline.data.prepare"):
        data = prepare(spec)
    assert "preparing it again" in caplog.text and str(first.root) in caplog.text
    assert np.array_equal(np.load(data.root / "train.tokens.npy"), tokens)
    assert (data.root / "tokenizer" / "tokenizer_config.json").read_text() == config
    assert prepare_mod.incomplete(data.root, data.version) is None


def test_a_tampered_copy_handed_by_the_launcher_is_not_opened(tmp_path, monkeypatch):
    data = prepare(small_spec(tmp_path, shared_cache=False))
    monkeypatch.setenv(prepare_mod.PREPARED_DATA_ENV, str(data.root))
    assert prepare_mod.prepared_by_launcher() == data
    _same_size_other_tokens(data.root)
    assert prepare_mod.prepared_by_launcher() is None


def test_files_past_the_hashing_budget_are_checked_by_sampled_blocks(tmp_path, monkeypatch):
    """Opening a prepared directory hashes its smallest files whole up to VERIFY_WHOLE_BYTES in all; the largest by
    their size and blocks spread from the first byte to the last, so a change in one of those blocks is seen."""
    monkeypatch.setattr(prepare_mod, "VERIFY_WHOLE_BYTES", 64 << 10)
    monkeypatch.setattr(prepare_mod, "SAMPLE_BLOCK_BYTES", 256)
    spec = small_spec(tmp_path, shared_cache=False)
    data = prepare(spec)
    sums = json.loads((data.root / "meta.json").read_text())["sha256"]
    assert sums["train.tokens.npy"].startswith("sampled:") and not sums["stats.json"].startswith("sampled:")
    assert prepare_mod.incomplete(data.root, data.version) is None
    _same_size_other_tokens(data.root)  # the last bytes: inside the last sampled block
    assert "train.tokens.npy" in prepare_mod.incomplete(data.root, data.version)
