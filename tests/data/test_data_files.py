"""The rows people have, read as they are, and nothing silent (docs/data.md, Files, Mixtures, Bad input): a directory
skips hidden copies and names every file it does not read; gzipped JSON, upper-case suffixes, a UTF-8 BOM and CRLF
line ends read; a `datasets` save_to_disk directory reads as its dataset; a mixture counts its drops per repeat;
`--show` marks dropped examples as dropped; a row in both training and held-out splits is warned."""

from __future__ import annotations

import gzip
import json
import logging
import sys
from collections import Counter
from pathlib import Path

import pytest

from shardline.data import encode, sources
from shardline.data.sources import open_sources, read_examples
from shardline.data.tokenizer import train_bpe
from shardline.errors import DataError
from shardline.example import Example
from shardline.spec import DataSpec
from shardline.tasks import get_task
from tests.conftest import small_spec


def _rows(n: int, tag: str = "") -> list[dict]:
    return [{"prompt": f"{tag}question {i}?", "completion": f" answer {i}."} for i in range(n)]


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _read(path: Path | str) -> list[Example]:
    spec = DataSpec(path=str(path))
    (source,) = open_sources(spec)
    return [ex for _, ex in read_examples(source.rows(), source.reading, Counter())]


@pytest.fixture(autouse=True)
def _every_warning_said():
    """Each test sees the warnings its sources give (they are said once per process otherwise)."""
    sources._SAID.clear()
    yield
    sources._SAID.clear()


def test_a_directory_skips_hidden_copies_and_names_every_file_it_does_not_read(tmp_path, caplog):
    data = tmp_path / "data"
    (data / ".ipynb_checkpoints").mkdir(parents=True)
    (data / "train.jsonl").write_text(_jsonl(_rows(10)))
    (data / ".ipynb_checkpoints" / "train-checkpoint.jsonl").write_text(_jsonl(_rows(10)))
    (data / ".hidden.jsonl").write_text(_jsonl(_rows(3)))
    (data / "_SUCCESS").write_text("")
    (data / "README.md").write_text("# my data")
    (data / "notes.txt").write_text("todo")
    (data / "extra.csv").write_text("a,b\n1,2\n")
    with caplog.at_level(logging.WARNING):
        examples = _read(data)
    assert len(examples) == 10  # the notebook's copy would double every row (and leak validation into training)
    said = caplog.text
    assert "skipped 5 files and 1 hidden folder" in said
    for name in ("README.md", "notes.txt", "extra.csv", "_SUCCESS", ".hidden.jsonl", ".ipynb_checkpoints/"):
        assert name in said


def test_the_skipped_files_are_said_once_per_process(tmp_path, caplog):
    (tmp_path / "a.jsonl").write_text(_jsonl(_rows(3)))
    (tmp_path / "README.md").write_text("hi")
    with caplog.at_level(logging.WARNING):
        _read(tmp_path)
        _read(tmp_path)
    assert caplog.text.count("README.md") == 1


def test_a_directory_of_no_data_file_names_what_it_holds(tmp_path):
    (tmp_path / "rows.csv").write_text("a\n1\n")
    with pytest.raises(DataError) as e:
        _read(tmp_path)
    assert "rows.csv" in str(e.value) and ".jsonl.gz" in str(e.value)


def test_gzipped_json_lines_and_arrays_and_upper_case_suffixes_are_read(tmp_path):
    data = tmp_path / "shards"
    data.mkdir()
    with gzip.open(data / "a.jsonl.gz", "wt") as f:
        f.write(_jsonl(_rows(4, "a ")))
    with gzip.open(data / "b.json.gz", "wt") as f:
        json.dump(_rows(3, "b "), f, indent=1)
    (data / "C.JSONL").write_text(_jsonl(_rows(2, "c ")))
    (data / "D.Json").write_text(json.dumps(_rows(1, "d ")))
    prompts = [ex.prompt for ex in _read(data)]
    assert len(prompts) == 10 and {p.split()[0] for p in prompts} == {"a", "b", "c", "d"}
    assert len(_read(data / "a.jsonl.gz")) == 4 and len(_read(data / "C.JSONL")) == 2
    assert len(_read(f"{data}/*.gz")) == 7


def test_a_gzipped_row_over_the_bound_is_skipped_unread_like_any_other(tmp_path, monkeypatch):
    from shardline.data import rowfiles

    monkeypatch.setattr(rowfiles, "MAX_ROW_BYTES", 1000)
    rows = _rows(5)
    rows[2]["completion"] = "x" * 5000
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write(_jsonl(rows))
    spec = DataSpec(path=str(tmp_path / "a.jsonl.gz"))
    (source,) = open_sources(spec)
    dropped: Counter = Counter()
    assert len(list(read_examples(source.rows(), spec, dropped))) == 4 and dropped == {"too_large": 1}


def test_a_broken_gzip_file_is_an_error_naming_it(tmp_path):
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl(_rows(50)).encode())[:-40])
    with pytest.raises(DataError) as e:
        _read(tmp_path / "a.jsonl.gz")
    assert "a.jsonl.gz" in str(e.value)


def test_a_byte_order_mark_and_crlf_line_ends_read(tmp_path):
    lines = (tmp_path / "lines.jsonl")
    lines.write_bytes(b"\xef\xbb\xbf" + _jsonl(_rows(3)).replace("\n", "\r\n").encode())
    assert [ex.prompt for ex in _read(lines)] == [r["prompt"] for r in _rows(3)]
    array = tmp_path / "array.json"
    array.write_bytes(b"\xef\xbb\xbf" + json.dumps(_rows(3), indent=1).replace("\n", "\r\n").encode())
    assert len(_read(array)) == 3
    joined = tmp_path / "joined.json"  # two files joined with `cat`, each with its mark
    joined.write_bytes(b"\xef\xbb\xbf" + _jsonl(_rows(2)).encode() + b"\xef\xbb\xbf" + _jsonl(_rows(2)).encode())
    assert len(_read(joined)) == 4


def test_a_save_to_disk_directory_reads_as_its_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(_rows(6)).save_to_disk(str(tmp_path / "saved"))
    assert [ex.prompt for ex in _read(tmp_path / "saved")] == [r["prompt"] for r in _rows(6)]
    (source,) = open_sources(DataSpec(path=str(tmp_path / "saved")))
    datasets.Dataset.from_list(_rows(7)).save_to_disk(str(tmp_path / "other"))
    (other,) = open_sources(DataSpec(path=str(tmp_path / "other")))
    assert source.fingerprint != other.fingerprint and source.name == "saved"


def test_a_saved_dataset_dict_reads_its_train_split_and_says_so(tmp_path, caplog):
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(_rows(5)),
                          "validation": datasets.Dataset.from_list(_rows(2, "v "))}).save_to_disk(str(tmp_path / "dd"))
    with caplog.at_level(logging.WARNING):
        assert len(_read(tmp_path / "dd")) == 5
    assert "validation" in caplog.text


def test_a_save_to_disk_directory_without_datasets_says_how_to_install_it(tmp_path, monkeypatch):
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_info.json").write_text("{}")
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (saved / "data-00000-of-00001.arrow").write_bytes(b"\0")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError) as e:
        _read(saved)
    assert "pip install 'shardline[hub]'" in str(e.value) and "save_to_disk" in str(e.value)


def _encode(monkeypatch, tmp_path, items, *overrides):
    spec = small_spec(tmp_path, "train.seq_len=16", *overrides)
    tok = train_bpe(["question answer long words " * 20], 300)
    settings = encode.EncodeSettings("unused", "none", "plain", "all", 16, spec.train.objective == "dpo")
    monkeypatch.setattr(encode, "_worker", {"settings": settings, "tok": tok, "template": get_task("none").prompt})
    return encode.encode_chunk(items)


def test_a_repeated_example_too_long_for_a_row_is_dropped_as_often_as_it_repeats(monkeypatch, tmp_path):
    short = Example(prompt="question", answer=" answer")
    long = Example(prompt="question", answer=" long words" * 30)
    arrays = _encode(monkeypatch, tmp_path, [("train", short, 2), ("train", long, 3), ("validation", long, 1)])
    # written to train.jsonl 5 times, packed 2: kept + dropped add up to what the examples file lists
    assert int(arrays["train.too_long"][0]) == 3 and len(arrays["train.lengths"]) == 2
    assert int(arrays["validation.too_long"][0]) == 1


def test_show_marks_dropped_examples_as_dropped_with_why_and_no_loss(tmp_path):
    from shardline.data.preview import rendered

    tok = train_bpe(["question answer long words " * 20], 300)
    spec = small_spec(tmp_path, "train.seq_len=16")
    short = Example(prompt="question", answer=" answer")
    over = Example(prompt="question", answer=" long words" * 8)  # a little over
    far = Example(prompt="question", answer=" long words" * 500)  # never tokenized whole
    shown = rendered(tok, [("train", short), ("train", over), ("validation", far)], spec)
    assert [item.get("dropped") for item in shown] == [None, "too_long", "too_long"]
    assert sum(shown[0]["loss"]) > 0
    for item in shown[1:]:
        assert not any(item["loss"]) and "train.seq_len=16" in item["why"]


def test_a_row_in_both_training_and_validation_is_warned(tmp_path, caplog):
    from shardline.data.splits import assign

    rows = _rows(40) * 2  # every row twice: held-out copies have a twin in training
    (tmp_path / "d.jsonl").write_text(_jsonl(rows))
    data = DataSpec(path=str(tmp_path / "d.jsonl"), validation_size=8, test_size=0)
    (source,) = open_sources(data)
    with caplog.at_level(logging.WARNING):
        a = assign(source, 0, data)
    assert len(a.held) == 8
    assert "also in training" in caplog.text and f"{tmp_path / 'd.jsonl'}:" in caplog.text


def test_a_mixtures_kept_examples_are_the_documents_packed(tmp_path):
    from shardline.data.prepare import prepare

    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    few = [{"question": f"q {i}", "answer": " ".join(words[: 3 + i])} for i in range(3)]
    few += [{"question": f"long {i}", "answer": " ".join(words * 30)} for i in range(3)]  # over a row, not far
    many = [{"question": f"other {i}", "answer": f"answer {i}"} for i in range(14)]
    (tmp_path / "few.jsonl").write_text(_jsonl(few))
    (tmp_path / "many.jsonl").write_text(_jsonl(many))
    spec = small_spec(tmp_path, f"data.sources=[{{path: {tmp_path / 'few.jsonl'}, weight: 3}}, "
                      f"{{path: {tmp_path / 'many.jsonl'}, weight: 1}}]", "data.validation_size=2",
                      "data.test_size=0", "data.train_size=null")
    data = prepare(spec)
    train = data.stats["splits"]["train"]
    assert data.stats["sources"][0]["repeats"] == 3  # 4 training rows, 12 of the mixture's 16
    rows = data.rows("train")
    packed = sum(int((rows.position_ids[r][: rows.n_real[r]] == 0).sum()) for r in range(len(rows.n_real)))
    assert train["kept"] == packed
    assert train["kept"] + data.stats["dropped"]["train:too_long"] == train["examples"] == 16
