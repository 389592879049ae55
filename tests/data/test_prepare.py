import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardline.data import assemble
from shardline.data import prepare as prepare_mod
from shardline.data.prepare import prepare
from shardline.data.template import encode_answer, encode_prompt
from shardline.errors import DataError, SpecError
from shardline.tasks.text_to_sql.prompt import SQL_PROMPT
from tests.conftest import small_spec


def _docs_of(rows, r):
    """Split packed row r into its documents using the position-id restarts."""
    pos = rows.position_ids[r][: rows.n_real[r]]
    starts = [i for i, p in enumerate(pos) if p == 0] + [int(rows.n_real[r])]
    return [(a, b) for a, b in zip(starts, starts[1:], strict=False)]


def test_loss_mask_covers_exactly_answer_and_eos(prepared):
    tok = prepared.tokenizer()
    rows = prepared.rows("train")
    answers = {}
    for ex in prepared.examples("train"):
        ids = encode_prompt(tok, SQL_PROMPT, ex.question, ex.context, "plain") + encode_answer(tok, ex.answer)
        answers[tuple(ids)] = len(encode_prompt(tok, SQL_PROMPT, ex.question, ex.context, "plain"))
    checked = 0
    for r in range(len(rows.n_real)):
        for a, b in _docs_of(rows, r):
            doc = tuple(int(t) for t in rows.tokens[r][a:b])
            n_prompt = answers[doc]
            mask = rows.loss_mask[r][a:b]
            assert mask[:n_prompt].sum() == 0 and mask[n_prompt:].all()
            assert doc[-1] == tok.eos_token_id and mask[-1] == 1  # the model learns to stop
            checked += 1
    stats = prepared.stats
    assert checked == stats["splits"]["train"]["kept"] == 600 - stats["dropped"].get("train:too_long", 0)
    assert int(np.asarray(rows.loss_mask).sum()) == stats["splits"]["train"]["loss_tokens"]


def test_packing_keeps_every_token_and_pads_are_not_eos(prepared):
    tok = prepared.tokenizer()
    rows = prepared.rows("train")
    stats = prepared.stats["splits"]["train"]
    assert int(rows.n_real.sum()) == stats["tokens"]
    lengths = [len(encode_prompt(tok, SQL_PROMPT, e.question, e.context, "plain")) + len(encode_answer(tok, e.answer))
               for e in prepared.examples("train")]
    expected = sum(n for n in lengths if n <= prepared.meta["seq_len"])
    assert expected == stats["tokens"]
    pad = prepared.meta["pad_id"]
    assert pad != tok.eos_token_id
    for r in range(len(rows.n_real)):
        assert (rows.tokens[r][rows.n_real[r]:] == pad).all()
    assert stats["fill"] > 0.65  # packing, not padding (examples are 40-190 tokens, rows 192)


def test_unpacked_rows_hold_one_example_each(session_dir, prepared):
    data = prepare(small_spec(session_dir, "data.packing=false"))
    assert data.version != prepared.version
    s = data.stats["splits"]["train"]
    assert s["rows"] == s["kept"] and s["tokens"] == prepared.stats["splits"]["train"]["tokens"]
    packed = prepared.stats["splits"]["train"]
    assert s["rows"] > packed["rows"] and s["fill"] < packed["fill"]


def test_prepare_is_cached_and_reused(session_dir, prepared, monkeypatch):
    def fail(*a, **k):
        raise AssertionError("prepared twice")

    monkeypatch.setattr(prepare_mod, "_build", fail)
    assert prepare(small_spec(session_dir)).root == prepared.root


def test_version_changes_with_seq_len(session_dir, prepared):
    assert prepare(small_spec(session_dir, "train.seq_len=160")).version != prepared.version


def test_crash_mid_prepare_leaves_no_directory_that_counts(tmp_path, monkeypatch):
    spec = small_spec(tmp_path, shared_cache=False)

    def crash(*a, **k):
        raise OSError("No space left on device")

    monkeypatch.setattr(assemble, "pack", crash)
    with pytest.raises(OSError):
        prepare(spec)
    cache = prepare_mod.default_cache_dir(spec)
    assert [p for p in cache.iterdir() if not p.name.startswith(".")] == []
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp")]
    monkeypatch.undo()
    data = prepare(spec)
    assert (data.root / "stats.json").exists()


def _rows(n):
    return [{"q": f"How many rows number {i}?", "ctx": "CREATE TABLE t (x INTEGER)", "sql": f"SELECT {i}"}
            for i in range(n)]


def test_user_jsonl_bad_rows_are_counted_not_dropped_silently(tmp_path):
    rows = _rows(60) + [{"q": "no answer column", "ctx": ""}, {"q": " ", "ctx": "", "sql": "SELECT 1"},
                        {"q": "long " * 400, "ctx": "", "sql": "SELECT 1"}]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    spec = small_spec(tmp_path, f"data.path={path}", "data.columns.question=q", "data.columns.context=ctx",
                      "data.columns.answer=sql", "data.validation_size=5", "data.test_size=5", "data.train_size=null")
    data = prepare(spec)
    dropped = data.stats["dropped"]
    assert dropped["missing_column"] == 1 and dropped["empty"] == 1
    assert sum(v for k, v in dropped.items() if k.endswith("too_long")) == 1
    splits = {s: {e.question for e in data.examples(s)} for s in ("train", "validation", "test")}
    assert not (splits["train"] & splits["test"]) and not (splits["train"] & splits["validation"])
    assert sum(len(v) for v in splits.values()) == 61


def test_parquet_source_matches_jsonl(tmp_path):
    rows = _rows(40)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    spec = small_spec(tmp_path, f"data.path={tmp_path / 'd.parquet'}", "data.columns.question=q",
                      "data.columns.context=ctx", "data.columns.answer=sql", "data.validation_size=4",
                      "data.test_size=4")
    data = prepare(spec)
    assert data.stats["splits"]["train"]["kept"] == 32


def test_wrong_column_mapping_names_the_columns(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _rows(10)))
    with pytest.raises(DataError, match="data.columns"):
        prepare(small_spec(tmp_path, f"data.path={path}"))


def test_missing_data_file_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="not found"):
        prepare(small_spec(tmp_path, f"data.path={tmp_path / 'missing.jsonl'}"))


def test_positions_restart_at_each_document(prepared):
    rows = prepared.rows("train")
    pos = np.asarray(rows.position_ids[0][: rows.n_real[0]])
    assert pos[0] == 0 and (np.diff(pos)[pos[1:] != 0] == 1).all()


def _corrupt_missing_file(root):
    (root / "train.tokens.npy").unlink()


def _corrupt_truncated_file(root):
    path = root / "validation.loss_mask.npy"
    path.write_bytes(path.read_bytes()[:100])


def _corrupt_interrupted_old_style(root):  # an older prepare killed mid-way: no stats.json, no file list
    (root / "stats.json").unlink()
    meta = json.loads((root / "meta.json").read_text())
    del meta["files"]
    (root / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("corrupt", [_corrupt_missing_file, _corrupt_truncated_file, _corrupt_interrupted_old_style])
def test_incomplete_prepared_directory_is_prepared_again(tmp_path, corrupt, caplog):
    spec = small_spec(tmp_path, shared_cache=False)
    first = prepare(spec)
    expected = {a: np.asarray(getattr(first.rows("validation"), a)).copy() for a in prepare_mod.ARRAYS}
    corrupt(first.root)
    leftover = first.root.parent / f".tmp-{first.version}-99999999"  # of a prepare killed mid-build
    leftover.mkdir()
    with caplog.at_level("WARNING", logger="shardline.data.prepare"):
        data = prepare(spec)
    assert data.root == first.root and prepare_mod.incomplete(data.root, data.version) is None
    assert str(first.root) in caplog.text and "preparing it again" in caplog.text
    assert not leftover.exists()
    assert len(data.rows("train").n_real) == data.stats["splits"]["train"]["rows"]
    rows = data.rows("validation")
    assert all(np.array_equal(getattr(rows, a), expected[a]) for a in prepare_mod.ARRAYS)  # same data again


def test_prepared_directory_deleted_during_a_run_is_a_named_error(tmp_path):
    data = prepare(small_spec(tmp_path, shared_cache=False))
    shutil.rmtree(data.root)
    for read in (lambda: data.rows("validation"), lambda: data.examples("test"), data.tokenizer,
                 lambda: data.meta):
        with pytest.raises(DataError) as err:
            read()
        assert err.value.where == str(data.root) and "shardline prepare" in err.value.fix
        assert "shardline train RUN_DIR" in err.value.fix


def test_data_path_url_names_the_field(tmp_path):
    with pytest.raises(SpecError) as err:
        prepare(small_spec(tmp_path, "data.path=s3://bucket/train.jsonl"))
    assert err.value.where == "data.path" and "s3://" in err.value.problem and "mount" in err.value.fix


def test_workers_open_the_launchers_prepared_copy_only_while_it_is_complete(session_dir, prepared, monkeypatch):
    """The local launcher hands its prepared directory to the workers (they skip regenerating the sources); a copy
    damaged since, or no hand-over at all (a cluster pod), falls back to preparing."""
    monkeypatch.delenv(prepare_mod.PREPARED_DATA_ENV, raising=False)
    assert prepare_mod.prepared_by_launcher() is None
    monkeypatch.setenv(prepare_mod.PREPARED_DATA_ENV, str(prepared.root))
    assert prepare_mod.prepared_by_launcher() == prepared
    copy = session_dir / "handed" / prepared.version
    shutil.copytree(prepared.root, copy)
    monkeypatch.setenv(prepare_mod.PREPARED_DATA_ENV, str(copy))
    assert prepare_mod.prepared_by_launcher().root == copy
    (copy / "meta.json").unlink()
    assert prepare_mod.prepared_by_launcher() is None
