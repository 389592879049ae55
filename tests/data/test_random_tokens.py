"""`data.task: random_tokens` (the benchmark protocols' rows): one document of `train.seq_len` uniformly random ids
per row, every token a target, drawn from `data.seed` into the prepared layout the loader reads."""

from __future__ import annotations

import numpy as np
import pytest

from shardline.data.prepare import prepare
from shardline.errors import SpecError
from shardline.spec.resolve import load_spec


def _spec(tmp_path, *extra: str):
    return load_spec("tiny", [f"run.dir={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'prepared'}",
                              "data.task=random_tokens", "data.train_size=24", "data.validation_size=3",
                              "train.seq_len=64", *extra])


def test_rows_are_whole_random_documents_every_token_a_target_and_seeded(tmp_path):
    spec = _spec(tmp_path)
    data = prepare(spec)
    vocab = data.tokenizer().vocab_size
    for split, n in (("train", 24), ("validation", 3)):
        rows = data.rows(split)
        assert rows.tokens.shape == (n, 64) and (np.asarray(rows.n_real) == 64).all()
        assert (np.asarray(rows.loss_mask) == 1).all()
        assert (np.asarray(rows.position_ids) == np.arange(64)).all()  # one document per row
        assert rows.tokens.min() >= 0 and rows.tokens.max() < vocab
    train = np.asarray(data.rows("train").tokens)
    counts = np.bincount(train.ravel(), minlength=vocab)
    assert (counts > 0).mean() > 0.95  # 1,536 draws over a ~300-id byte-level vocabulary: nearly all seen
    assert data.stats["splits"]["train"]["loss_tokens"] == 24 * 64 and data.stats["format"] == "random_tokens"
    assert data.examples("test") == []
    again = prepare(spec)
    assert again.version == data.version
    other = prepare(_spec(tmp_path, "data.seed=7"))
    assert other.version != data.version and not np.array_equal(np.asarray(other.rows("train").tokens), train)
    longer = prepare(_spec(tmp_path, "train.seq_len=32"))
    assert longer.version != data.version and longer.rows("train").tokens.shape == (24, 32)


def test_random_tokens_with_a_data_path_is_refused_by_name(tmp_path):
    with pytest.raises(SpecError) as e:
        _spec(tmp_path, f"data.path={tmp_path / 'x.jsonl'}")
    assert e.value.field == "data.task" and "reads no data" in str(e.value)
