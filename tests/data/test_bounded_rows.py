"""A dataset row comes from outside: what one row costs is bounded, whatever its size (docs/data.md, bad input).

A row over `MAX_ROW_BYTES` is skipped before it is parsed, counted `too_large` and named by file and line; an
example far longer than `train.seq_len` is dropped as `too_long` without tokenizing it whole; a long text document
is tokenized window by window, with the tokens of the whole; a `.json` array is read element by element. Peak memory
is measured in a child process against a normal preparation's (a row of 10 MB cost 1.6-2.1 GB before, one of 50 MB
9.3 GB and three minutes)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from shardline.data import render as render_mod
from shardline.data import rowfiles
from shardline.data import tokenizer as tokenizer_mod
from shardline.data.encode import EncodeSettings, _init, encode_chunk
from shardline.data.render import render_many, text_ids
from shardline.data.sources import open_sources, read_examples
from shardline.data.tokenizer import load_tokenizer, train_bpe, windows
from shardline.errors import DataError
from shardline.example import Example
from shardline.spec import DataSpec
from shardline.tasks import get_task

ROOM_MIB = 128
"""What one large row may add to a normal preparation's peak (~270 MiB here); it added 1,300-9,000 MiB before."""
WORDS = "the quick brown fox jumps over the lazy dog, 42 times; naïve café 東京 — ok?\n"

PREPARE = r"""
import json, sys
from pathlib import Path
from shardline.data.prepare import prepare
from shardline.spec.resolve import load_spec
root, data, fmt = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
spec = load_spec("tiny", [f"run.dir={root}/runs", f"data.cache_dir={root}/cache", "model.arch.vocab_size=512",
                          "data.validation_size=8", "data.test_size=0", "data.train_size=null", "train.seq_len=192",
                          "parallel.nproc_per_node=1", f"data.path={data}", f"data.format={fmt}", *sys.argv[4:]])
d = prepare(spec)
print("STATS " + json.dumps({"dropped": d.stats["dropped"], "train": d.stats["splits"]["train"],
                             "validation": d.stats["splits"]["validation"]}))
"""


PEAK = """
import resource
from pathlib import Path
hwm = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines() if "VmHWM" in line)
print("PEAK", max(hwm, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
"""
"""The child's own peak (VmHWM: ru_maxrss would count the test process's memory, shared until the child's exec)."""


def _peak_mib(script: str, args: list[str], cwd: Path, limit_mib: float, timeout: float = 300
              ) -> tuple[float, str, str]:
    """Run `script` with `args` in a child process and return its peak RSS (MiB, as the child measures itself),
    stdout and stderr; the child is killed, and the test fails, as soon as its peak passes `limit_mib` (the
    unbounded reading of a large row took minutes and gigabytes)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, "-c", script + PEAK, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            hwm = next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith("VmHWM"))
        except (OSError, StopIteration):
            hwm = 0
        if hwm / 1024 > limit_mib or time.monotonic() > deadline:
            proc.kill()
            proc.communicate()
            pytest.fail(f"peak RSS {hwm / 1024:.0f} MiB passed {limit_mib:.0f} MiB (or the {timeout:.0f} s limit)")
        time.sleep(0.02)
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    peak = next(int(line.split()[1]) for line in out.splitlines() if line.startswith("PEAK ")) / 1024
    return peak, out, err


def _rows(fmt: str, n: int = 300) -> list[dict]:
    body = [f"document {i} " + "lorem ipsum dolor " * (3 + i % 30) for i in range(n)]
    if fmt == "text":
        return [{"text": b} for b in body]
    return [{"prompt": f"question {i}?", "completion": b} for i, b in enumerate(body)]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def _prepare(tmp: Path, data: Path, fmt: str, limit_mib: float, *overrides: str) -> tuple[float, dict, str]:
    peak, out, err = _peak_mib(PREPARE, [str(tmp), str(data), fmt, *overrides], tmp, limit_mib)
    stats = json.loads(next(line for line in out.splitlines() if line.startswith("STATS "))[6:])
    return peak, stats, err


@pytest.fixture(scope="module")
def normal_peak(tmp_path_factory) -> float:
    """Peak RSS of preparing the normal rows the tests below add one large row to."""
    tmp = tmp_path_factory.mktemp("normal")
    peak, _, _ = _prepare(tmp, _write_jsonl(tmp / "d.jsonl", _rows("prompt_completion")), "prompt_completion", 4096)
    return peak


def _big(nbytes: int) -> str:
    return ("lorem ipsum dolor sit amet " * (nbytes // 27 + 1))[:nbytes]


def test_a_50_mb_row_is_skipped_unread_counted_too_large_and_named_by_its_line(tmp_path, normal_peak):
    rows = _rows("prompt_completion")
    rows.insert(150, {"prompt": "a question?", "completion": _big(50_000_000)})
    data = _write_jsonl(tmp_path / "big.jsonl", rows)
    started = time.monotonic()
    peak, stats, err = _prepare(tmp_path, data, "prompt_completion", normal_peak + ROOM_MIB)
    assert stats["dropped"] == {"too_large": 1}
    assert stats["train"]["examples"] + stats["validation"]["examples"] == 300
    assert f"{data}:151" in err and "too_large" in err
    assert peak < normal_peak + ROOM_MIB and time.monotonic() - started < 60


def test_an_example_far_longer_than_seq_len_is_dropped_as_too_long_without_tokenizing_it_whole(tmp_path,
                                                                                              normal_peak):
    rows = _rows("prompt_completion")
    rows.insert(10, {"prompt": "a question?", "completion": _big(10_000_000)})
    peak, stats, _ = _prepare(tmp_path, _write_jsonl(tmp_path / "big.jsonl", rows), "prompt_completion",
                              normal_peak + ROOM_MIB)
    assert sum(n for reason, n in stats["dropped"].items() if reason.endswith(":too_long")) == 1
    assert "too_large" not in stats["dropped"]
    assert peak < normal_peak + ROOM_MIB


def test_a_long_text_document_is_kept_whole_at_a_bounded_cost(tmp_path, normal_peak):
    rows = _rows("text")
    rows.insert(10, {"text": _big(4_000_000)})
    peak, stats, _ = _prepare(tmp_path, _write_jsonl(tmp_path / "big.jsonl", rows), "text", normal_peak + ROOM_MIB)
    assert stats["dropped"] == {}
    assert stats["train"]["tokens"] + stats["validation"]["tokens"] > 4_000_000 // 27 * 5  # every piece kept
    assert peak < normal_peak + ROOM_MIB


def test_many_large_rows_are_tokenized_a_bounded_chunk_at_a_time(tmp_path, normal_peak):
    rows = _rows("prompt_completion")
    tokenizer = tmp_path / "tokenizer"
    train_bpe([_big(100_000)] + [row["completion"] for row in rows], 512).save_pretrained(tokenizer)
    for i in range(30):  # 90 MB in rows of 3 MB: in one chunk, held, sent, tokenized and written all together
        rows.insert(5 * i, {"prompt": f"question {i}?", "completion": _big(3_000_000)})
    peak, stats, _ = _prepare(tmp_path, _write_jsonl(tmp_path / "big.jsonl", rows), "prompt_completion",
                              normal_peak + ROOM_MIB, f"model.tokenizer={tokenizer}")
    assert sum(n for reason, n in stats["dropped"].items() if reason.endswith(":too_long")) == 30
    assert peak < normal_peak + ROOM_MIB


SHOW = r"""
import json, sys
from pathlib import Path
from shardline.data.preflight import preflight
from shardline.data.prepare import prepare
from shardline.data.preview import rendered
from shardline.spec.resolve import load_spec
root, data, tokenizer = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
spec = load_spec("tiny", [f"run.dir={root}/runs", f"data.cache_dir={root}/cache", "model.arch.vocab_size=512",
                          "data.validation_size=8", "data.test_size=0", "data.train_size=null", "train.seq_len=192",
                          "parallel.nproc_per_node=1", f"data.path={data}", f"model.tokenizer={tokenizer}"])
preflight(spec)
d = prepare(spec)
shown = rendered(d.tokenizer(), [("train", ex) for ex in d.examples("train")[:3]], spec)
print("STATS " + json.dumps({"dropped": d.stats["dropped"], "shown": len(shown)}))
"""
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_conversation_far_longer_than_seq_len_is_checked_prepared_and_shown_at_a_bounded_cost(tmp_path, normal_peak):
    rows = [{"messages": [{"role": "user", "content": f"question {i}?"},
                          {"role": "assistant", "content": f"answer {i} " + "lorem ipsum " * (i % 20)}]}
            for i in range(300)]
    tok = train_bpe([r["messages"][1]["content"] for r in rows], 512)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.save_pretrained(tmp_path / "tokenizer")
    rows.insert(0, {"messages": [{"role": "user", "content": "tell me everything"},
                                 {"role": "assistant", "content": _big(10_000_000)}]})
    data = _write_jsonl(tmp_path / "chat.jsonl", rows)
    peak, out, _ = _peak_mib(SHOW, [str(tmp_path), str(data), str(tmp_path / "tokenizer")], tmp_path,
                             normal_peak + ROOM_MIB)
    stats = json.loads(next(line for line in out.splitlines() if line.startswith("STATS "))[6:])
    assert sum(n for reason, n in stats["dropped"].items() if reason.endswith(":too_long")) == 1
    assert stats["shown"] >= 2 and peak < normal_peak + ROOM_MIB


READ = r"""
import sys
from collections import Counter
from shardline.data.sources import open_sources, read_examples
from shardline.spec import DataSpec
spec = DataSpec(path=sys.argv[1], format="instruction")
dropped = Counter()
n = sum(1 for _ in read_examples(open_sources(spec)[0].rows(), spec, dropped))
print("ROWS", n, dict(dropped))
"""


def _alpaca(path: Path, n: int) -> Path:
    with path.open("w") as f:
        f.write("[\n")
        for i in range(n):
            row = {"instruction": f"translate {i} " + "word " * (i % 50), "input": "good morning",
                   "output": "bonjour " * (1 + i % 40)}
            f.write(("  " if i == 0 else ", ") + json.dumps(row, indent=1) + "\n")
        f.write("]\n")
    return path


def test_a_json_array_is_read_element_by_element(tmp_path):
    small = _alpaca(tmp_path / "small.json", 1_000)
    large = _alpaca(tmp_path / "large.json", 140_000)  # ~52 MB: read whole, it cost ~250 MB more
    assert large.stat().st_size > 50_000_000
    base, out, _ = _peak_mib(READ, [str(small)], tmp_path, 2048)
    assert "ROWS 1000 {}" in out
    peak, out, _ = _peak_mib(READ, [str(large)], tmp_path, base + 32)
    assert "ROWS 140000 {}" in out and peak < base + 32


def test_a_json_array_element_over_the_cap_is_skipped_and_named(tmp_path):
    path = tmp_path / "rows.json"
    rows = [{"instruction": f"say {i}", "output": "ok"} for i in range(5)]
    rows[2]["output"] = "x" * (rowfiles.MAX_ROW_BYTES + 10)
    path.write_text(json.dumps(rows, indent=2))
    spec = DataSpec(path=str(path))
    dropped: Counter = Counter()
    named: list = []
    examples = [ex for _, ex in read_examples(open_sources(spec)[0].rows(), spec, dropped, too_large=named)]
    assert [ex.question for ex in examples] == ["say 0", "say 1", "say 3", "say 4"]
    assert dropped == {"too_large": 1} and named[0][0] == f"{path}#3" and named[0][1] > rowfiles.MAX_ROW_BYTES


@pytest.mark.parametrize("text", [
    '[{"a": 1}, {"b": [1, 2, {"c": "]},\\"["}]}, {}]',
    ' \n[ ]\n',
    '[{"s": "\\\\"}, {"t": "\\u00e9\\ud83d\\ude00"}]',
])
def test_the_array_reader_reads_what_json_reads(tmp_path, monkeypatch, text):
    monkeypatch.setattr(rowfiles, "READ_CHARS", 3)  # elements, strings and escapes cut across reads
    path = tmp_path / "a.json"
    path.write_text(text)
    assert [row for _, row in rowfiles.json_array(path)] == json.loads(text)


def _random_json(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 3 or r < 0.3:
        return rng.choice([1, -2.5e3, 1.5e-7, "s", 'a"b\\c]}{[,', "é😀\n", True, None, ""])
    if r < 0.65:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {f"k{i}": _random_json(rng, depth + 1) for i in range(rng.randint(0, 4))}


def test_the_array_reader_reads_what_json_reads_and_fails_where_it_fails(tmp_path, monkeypatch):
    rng, path = random.Random(0), tmp_path / "a.json"
    for trial in range(200):
        text = json.dumps([_random_json(rng) for _ in range(rng.randint(0, 5))], indent=rng.choice([None, 1]),
                          ensure_ascii=rng.random() < 0.5)
        if trial % 2:  # broken: a character dropped or one added
            at = rng.randrange(1, len(text))
            text = text[:at] + rng.choice(["", "]", "{", ",", '"', ":", "x", "\\"]) + text[at + 1:]
        path.write_text(text)
        try:
            expected = json.loads(text)
        except ValueError:
            expected = DataError
        for read_chars in (1, 7, 1 << 20):
            monkeypatch.setattr(rowfiles, "READ_CHARS", read_chars)
            try:
                got = [row for _, row in rowfiles.json_array(path)]
            except DataError:
                got = DataError
            assert got == expected, (text, read_chars)


def test_an_array_element_over_the_bound_is_passed_without_parsing_and_a_short_broken_one_is_an_error(
        tmp_path, monkeypatch):
    monkeypatch.setattr(rowfiles, "MAX_ROW_BYTES", 20)
    monkeypatch.setattr(rowfiles, "READ_CHARS", 3)
    path = tmp_path / "a.json"
    big = '{"big": "]}\\\\\\" ,[{' + "é" * 30 + '", "n": [1, {"m": 2}]}'
    path.write_text(f'[{{"a": 1}},\n {big},\n {{"c": 3}}]')
    skipped = rowfiles.TooLarge(len(big.encode()))
    assert list(rowfiles.json_array(path)) == [(f"{path}#1", {"a": 1}), (f"{path}#2", skipped), (f"{path}#3", {"c": 3})]
    path.write_text('[{"a": 1},\n {"b": },\n "' + "y" * 40 + '"]')
    with pytest.raises(DataError, match=f"{path}:2"):
        list(rowfiles.json_array(path))


@pytest.mark.parametrize(("text", "line"), [('[{"a": 1},\n {"b": 2}\n {"c": 3}]', 3), ('[{"a": 1},\n {"b": }]', 2),
                                            ('[{"a": 1}', 1), ('[{"a": "open}]', 1)])
def test_a_broken_json_array_is_an_error_naming_its_line(tmp_path, monkeypatch, text, line):
    monkeypatch.setattr(rowfiles, "READ_CHARS", 4)
    path = tmp_path / "a.json"
    path.write_text(text)
    with pytest.raises(DataError, match=f"{path}:{line}"):
        list(rowfiles.json_array(path))


def test_a_jsonl_line_that_is_not_utf8_is_an_error_naming_its_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"text": "fine"}\r\n\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=f"{path}:3.*UTF-8"):
        list(rowfiles.json_lines(path))
    path.write_bytes(b'{"text": "fine"}\r\n\n{"text": "caf\xc3\xa9"}')
    assert list(rowfiles.json_lines(path)) == [(f"{path}:1", {"text": "fine"}), (f"{path}:3", {"text": "café"})]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    tok = train_bpe([WORDS * 20, "    def f(x):\n        return x\n" * 20], 400)
    path = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(path)
    return path


def test_a_long_document_tokenized_in_windows_has_the_tokens_of_the_whole(tok, monkeypatch):
    t = load_tokenizer(str(tok))
    monkeypatch.setattr(render_mod, "TEXT_WINDOW", 200)
    code = "".join(f"    def f{i}(x):\n        return x  +  {i}\n\n" for i in range(40))
    for text in (WORDS * 50, code, (WORDS + code) * 3):
        whole = [t.bos_token_id, *t.encode(text, add_special_tokens=False), t.eos_token_id]
        assert text_ids(t, text).tolist() == whole


def test_a_tokenizer_trained_on_long_texts_window_by_window_is_the_one_trained_on_them_whole(monkeypatch):
    code = "".join(f"    def f{i}(x):\n        return x  +  {i}\n\n" for i in range(40))
    texts = [(WORDS + code) * 30, WORDS * 50]
    whole = train_bpe(texts, 400).backend_tokenizer.to_str()
    monkeypatch.setattr(tokenizer_mod, "TEXT_WINDOW", 300)
    assert train_bpe(texts, 400).backend_tokenizer.to_str() == whole


def test_text_pieces_are_cut_at_seq_len_each_starting_afresh(tok):
    t = load_tokenizer(str(tok))
    _init(EncodeSettings(str(tok), "none", "plain", "all", 64, False))
    texts = [WORDS * k for k in (1, 3, 17)]
    arrays = encode_chunk([("train", Example(text=text), 1) for text in texts])
    expected_ids, expected_lengths, expected_loss = [], [], []
    for text in texts:
        ids = [t.bos_token_id, *t.encode(text, add_special_tokens=False), t.eos_token_id]
        for a in range(0, len(ids), 64):
            expected_ids += ids[a:a + 64]
            expected_lengths.append(len(ids[a:a + 64]))
            expected_loss += [0] + [1] * (len(ids[a:a + 64]) - 1)
    assert arrays["train.ids"].tolist() == expected_ids and arrays["train.lengths"].tolist() == expected_lengths
    assert arrays["train.loss"].tolist() == expected_loss and arrays["train.too_long"].tolist() == [0]


@pytest.mark.parametrize("fmt", ["plain", "chat"])
def test_too_long_decided_by_counting_windows_is_too_long_by_tokenizing(tok, monkeypatch, fmt):
    t = load_tokenizer(str(tok))
    t.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>\n{% endfor %}"
                       "{% if add_generation_prompt %}<assistant>{% endif %}")
    monkeypatch.setattr(render_mod, "TEXT_WINDOW", 100)
    template = get_task("none").prompt
    examples = [Example(question="q", answer=WORDS * k) for k in (1, 2, 3, 5, 8, 13)]
    examples += [Example(messages=[{"role": "user", "content": WORDS * k}, {"role": "assistant", "content": "a"}])
                 for k in (1, 2, 3, 5, 8, 13)]
    whole = render_many(t, examples, template, fmt)
    for limit in (40, 64, 100, 150, 200):
        bounded = render_many(t, examples, template, fmt, max_tokens=limit)
        for w, b in zip(whole, bounded, strict=True):
            assert len(w.ids) > limit if b is None else b == w
        assert bounded[5] is None and bounded[-1] is None  # the longest, decided without tokenizing them whole


def test_a_window_ends_before_a_space_between_words_else_after_a_line_break_else_at_its_size():
    assert list(windows("aaaa bbbb cccc\ndddd", 10)) == ["aaaa bbbb", " cccc\ndddd"]
    assert list(windows("aaaaaa\nbbbbbbbbbb", 10)) == ["aaaaaa\n", "bbbbbbbbbb"]
    assert list(windows("aaaa  bb\n\n  cc", 10)) == ["aaaa  bb\n\n", "  cc"]
    assert list(windows("x" * 25, 10)) == ["x" * 10, "x" * 10, "x" * 5]
    assert [len(w) for w in windows("x" * 50, 16, first=4)] == [4, 8, 16, 16, 6]  # counting: no more than it takes
