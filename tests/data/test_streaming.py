"""Preparation at scale (docs/data.md): the chunked, parallel tokenization gives the same prepared data as one
process, an interrupted preparation resumes from the chunks it completed, packing window by window keeps every
token, and a mixture gives each source its weight's share, the same on every preparation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardline.data import assemble, encode
from shardline.data import prepare as prepare_mod
from shardline.data.prepare import ARRAYS, prepare
from tests.conftest import small_spec


def _qa(path: Path, n: int, tag: str = "") -> Path:
    path.write_text("".join(json.dumps({"question": f"{tag}question {i} " + "word " * (i % 13),
                                        "answer": f"{tag}answer {i}" + " more" * (i % 7)}) + "\n" for i in range(n)))
    return path


def _text(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"text": f"document {i} " + "lorem ipsum " * (5 + i % 40)}) + "\n"
                            for i in range(n)))
    return path


def _arrays(data, split="train"):
    rows = data.rows(split)
    return {a: np.asarray(getattr(rows, a)).copy() for a in ARRAYS}


def _spec(root: Path, data: Path, *extra: str):
    return small_spec(root, f"data.path={data}", "data.validation_size=8", "data.test_size=0",
                      "data.train_size=null", *extra, shared_cache=False)  # tests that interrupt a preparation


@pytest.mark.slow
def test_parallel_chunks_give_the_prepared_data_of_one_process(tmp_path, monkeypatch):
    source = _qa(tmp_path / "qa.jsonl", 700)
    monkeypatch.setattr(encode, "CHUNK", 64)
    one = prepare(_spec(tmp_path / "one", source))
    monkeypatch.setattr(encode, "POOL_MIN_EXAMPLES", 0)  # worker processes, one per core, from the first chunk on
    many = prepare(_spec(tmp_path / "many", source))
    assert one.version == many.version and one.root != many.root
    for split in ("train", "validation"):
        a, b = _arrays(one, split), _arrays(many, split)
        assert all(np.array_equal(a[k], b[k]) for k in ARRAYS), split
    assert one.examples("train") == many.examples("train") and one.stats == many.stats


def test_an_interrupted_preparation_resumes_from_the_chunks_it_completed(tmp_path, monkeypatch):
    source = _qa(tmp_path / "qa.jsonl", 700)
    monkeypatch.setattr(encode, "CHUNK", 64)  # 692 examples: 11 chunks
    spec = _spec(tmp_path, source)
    reference = prepare(_spec(tmp_path / "reference", source))
    written = []
    real_write = encode._write

    def write_then_die(k, *args):
        if len(written) == 4:
            raise KeyboardInterrupt("killed mid-preparation")
        written.append(k)
        real_write(k, *args)

    monkeypatch.setattr(encode, "_write", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        prepare(spec)
    cache = prepare_mod.default_cache_dir(spec)
    partial = next(cache.glob(".partial-*"))
    assert len(list((partial / "chunks").glob("*.npz"))) == 4 and not [p for p in cache.iterdir()
                                                                        if not p.name.startswith(".")]
    monkeypatch.setattr(encode, "_write", real_write)
    encoded = []
    real_encode = encode.encode_chunk
    monkeypatch.setattr(encode, "encode_chunk", lambda chunk: encoded.append(len(chunk)) or real_encode(chunk))
    data = prepare(spec)
    assert len(encoded) == 11 - 4  # the four completed chunks were not tokenized again
    assert not partial.exists() and data.version == reference.version
    a, b = _arrays(data), _arrays(reference)
    assert all(np.array_equal(a[k], b[k]) for k in ARRAYS)


def test_packing_window_by_window_keeps_every_token_of_every_document(tmp_path, monkeypatch):
    source = _text(tmp_path / "docs.jsonl", 120)
    whole = prepare(_spec(tmp_path / "whole", source))
    monkeypatch.setattr(assemble, "WINDOW", 7)
    windows = prepare(_spec(tmp_path / "windows", source, "data.cache_dir=" + str(tmp_path / "other-cache")))
    for data in (whole, windows):
        rows = data.rows("train")
        stats = data.stats["splits"]["train"]
        assert int(rows.n_real.sum()) == stats["tokens"] == data.stats["sources"][0]["tokens"]["train"]
        assert int(rows.loss_mask.sum()) == stats["loss_tokens"]
    assert windows.stats["splits"]["train"]["tokens"] == whole.stats["splits"]["train"]["tokens"]
    assert windows.stats["splits"]["train"]["rows"] >= whole.stats["splits"]["train"]["rows"]


def test_a_mixture_gives_each_source_its_weighted_share_the_same_every_time(tmp_path):
    qa, docs = _qa(tmp_path / "qa.jsonl", 100, "qa "), _text(tmp_path / "docs.jsonl", 40)
    sources = [f"data.sources=[{{path: {qa}, weight: 3}}, {{path: {docs}, weight: 1, name: books}}]"]
    spec = small_spec(tmp_path, *sources, "data.validation_size=4", "data.test_size=0", "data.train_size=null")
    data = prepare(spec)
    mixed = data.stats["sources"]
    assert [s["name"] for s in mixed] == ["qa", "books"] and [s["format"] for s in mixed] == ["question_answer",
                                                                                                "text"]
    # 96 + 36 training examples, shares 3:1 of 132: 99 (all 96 once, 3 twice) and 33 (a subset of 36)
    assert [s["train_examples"] for s in mixed] == [99, 33]
    train = data.examples("train")
    assert sum(e.source == "qa" for e in train) == 99 and sum(e.source == "books" for e in train) == 33
    assert len({e.question for e in train if e.source == "qa"}) == 96
    assert data.stats["splits"]["validation"]["examples"] == 8  # the validation size per source
    by_row = np.asarray(np.load(data.root / "validation.source.npy"))
    assert set(by_row.tolist()) == {0, 1}
    again = prepare(small_spec(tmp_path / "again", *sources, "data.validation_size=4", "data.test_size=0",
                               "data.train_size=null"))
    assert again.version == data.version and again.examples("train") == train
    assert all(np.array_equal(_arrays(again)[k], _arrays(data)[k]) for k in ARRAYS)


@pytest.mark.slow
def test_a_script_without_a_main_guard_prepares_in_parallel_and_runs_once(tmp_path):
    """Worker processes never run the caller's script again (multiprocessing would re-import a `__main__` file)."""
    import subprocess
    import sys

    from tests.conftest import REPO

    source = _qa(tmp_path / "qa.jsonl", 300)
    script = tmp_path / "script.py"
    script.write_text(
        "print('script body runs', flush=True)\n"
        "from shardline.data import encode\n"
        "encode.POOL_MIN_EXAMPLES, encode.CHUNK = 0, 50\n"
        "from shardline.spec.resolve import load_spec\n"
        "from shardline.data.prepare import prepare\n"
        f"data = prepare(load_spec('tiny', ['run.dir={tmp_path}', 'data.path={source}', 'data.validation_size=8',"
        " 'data.train_size=null']))\n"
        "print('prepared', data.stats['splits']['train']['examples'])\n")
    out = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("script body runs") == 1 and "prepared 292" in out.stdout
