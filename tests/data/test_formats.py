"""Data formats (docs/data.md): each layout and format reads into the examples it says, conversations render to
exactly the tokenizer's own chat-template ids with the loss on exactly the assistant turns — against transformers'
`apply_chat_template` / `return_assistant_tokens_mask` and TRL's SFT tokenization (code nobody here wrote) — and
bad input is a named error before anything is written."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardline.data.formats import FORMATS
from shardline.data.preflight import preflight
from shardline.data.prepare import prepare
from shardline.data.render import render, render_chat
from shardline.data.tokenizer import train_bpe
from shardline.errors import DataError, ShardlineError, SpecError
from shardline.tasks import get_task
from tests.conftest import run_cli, small_overrides, small_spec
from tests.data.tokenizers import chatml_tokenizer

# ChatML with transformers' generation markers around what an assistant says (content and end of turn).
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['role'] == 'assistant' %}"
          "{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}\n{% else %}{{ message['content'] }}"
          "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_SENTENCE = ("hello world how are you today the capital of France is Paris SELECT name FROM users WHERE age "
             "translate good morning bonjour a document of text")
WORDS = tuple(_SENTENCE.split())


def _conversation(i: int, turns: int = 2) -> list[dict]:
    out = [{"role": "system", "content": "You answer briefly."}]
    for t in range(turns):
        out += [{"role": "user", "content": f"{WORDS[(i + t) % len(WORDS)]} question {i} turn {t}?"},
                {"role": "assistant", "content": f"answer {i} {WORDS[(3 * i + t) % len(WORDS)]} turn {t}."}]
    return out


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE with ChatML's special tokens and template, saved as a model's tokenizer directory."""
    texts = [" ".join(WORDS)] * 20 + [m["content"] for i in range(40) for m in _conversation(i)]
    return chatml_tokenizer(texts, 400, CHATML, tmp_path_factory.mktemp("chat-tokenizer"))


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _spec(tmp_path: Path, data: Path | str, tokenizer: Path | None, *extra: str):
    tok = [f"model.tokenizer={tokenizer}"] if tokenizer else []
    return small_spec(tmp_path, f"data.path={data}", "data.validation_size=4", "data.test_size=0",
                      "data.train_size=null", *tok, *extra)


def test_conversation_ids_are_the_chat_templates_and_the_loss_is_transformers_assistant_mask(chat_tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_tokenizer)
    for i in range(6):
        turns = 1 + i % 3
        messages = _conversation(i, turns)
        r = render_chat(tok, messages)
        theirs = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert r.ids == list(theirs["input_ids"])
        assert r.loss == list(theirs["assistant_masks"])
        assert tok.decode([t for t, m in zip(r.ids, r.loss, strict=True) if m]).count("<|im_end|>") == turns
        last = render_chat(tok, messages, assistant_turns="last")
        assert last.ids == r.ids and (0 < sum(last.loss) < sum(r.loss) if turns > 1 else last.loss == r.loss)


def test_marked_and_prefix_renderings_find_the_same_spans_and_a_transforming_template_falls_back(chat_tokenizer):
    """Turns are located with one marked rendering; a template that rewrites contents (here: trims them) fails the
    marks' check and is located by rendering each turn's prefix, with the same loss on what it says."""
    from transformers import AutoTokenizer

    from shardline.data import render as render_mod

    tok = AutoTokenizer.from_pretrained(chat_tokenizer)
    for i in range(8):
        messages = _conversation(i, 1 + i % 3)
        text, spans = render_mod.chat_spans(tok, messages)
        trained = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        assert spans == render_mod._prefix_spans(tok, messages, trained, text)
    tok.chat_template = CHATML.replace("{{ message['content'] }}", "{{ message['content'] | trim }}")
    messages = [{"role": "user", "content": "  hello  "}, {"role": "assistant", "content": "  world  "}]
    text, spans = render_mod.chat_spans(tok, messages)
    assert render_mod._marked_spans(tok, messages, [1], text) is None
    assert [text[a:b] for a, b in spans] == ["world<|im_end|>"]
    theirs = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert render_chat(tok, messages).loss == list(theirs["assistant_masks"])


def test_messages_and_prompt_completion_tokenize_as_trls_sft_trainer(chat_tokenizer, tmp_path):
    """TRL's SFTTrainer prepares the same rows (assistant-only loss, completion-only loss): the same ids and the same
    loss-bearing tokens. Plain prompts differ by design in one place: shardline adds exactly one BOS."""
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(chat_tokenizer)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    chats = [{"messages": _conversation(i, 1 + i % 2)} for i in range(4)]
    plain = [{"prompt": f"{WORDS[i]} question {i}? Answer:", "completion": f" {WORDS[i + 1]} answer {i}."}
             for i in range(4)]
    chat_pc = [{"prompt": _conversation(i, 1)[:2], "completion": _conversation(i, 1)[2:]} for i in range(4)]
    template = get_task("none").prompt
    for rows, settings in ((chats, {"assistant_only_loss": True}), (plain, {}), (chat_pc, {})):
        trainer = SFTTrainer(model=model, processing_class=tok, train_dataset=Dataset.from_list(rows),
                             args=SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **settings))
        fmt = next(f for f in FORMATS.values() if all(c in rows[0] for c in f.needs))
        for row, theirs in zip(rows, trainer.train_dataset, strict=True):
            r = render(tok, fmt.read(row, small_spec(tmp_path).data.columns), template, "plain")
            trl_loss = [int(label != -100) for label in theirs["labels"]]
            if fmt.name == "prompt_completion" and isinstance(row["prompt"], str):
                assert r.ids[0] == tok.bos_token_id and (r.ids[1:], r.loss[1:]) == (theirs["input_ids"], trl_loss)
            else:
                assert (r.ids, r.loss) == (theirs["input_ids"], trl_loss), fmt.name


def test_every_layout_and_format_prepares_with_its_loss_where_the_format_says(chat_tokenizer, tmp_path):
    n = 24
    messages = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": _conversation(i)} for i in range(n)])
    alpaca = tmp_path / "alpaca.json"  # a JSON array, Alpaca's own layout
    alpaca.write_text(json.dumps([{"instruction": f"translate {i}", "input": "good morning" if i % 2 else "",
                                   "output": f"bonjour {i}"} for i in range(n)], indent=1))
    pq.write_table(pa.Table.from_pylist([{"prompt": f"question {i}? Answer:", "completion": f" {i}"}
                                         for i in range(n)]), tmp_path / "pc.parquet")
    shards = tmp_path / "shards"
    shards.mkdir()
    for s in range(3):
        _write_jsonl(shards / f"part-{s}.jsonl", [{"conversations": [
            {"from": "human", "value": f"hello {s} {i}"}, {"from": "gpt", "value": f"world {i}"}]} for i in range(8)])
    text_dir = tmp_path / "text"
    text_dir.mkdir()
    long_doc = " ".join(WORDS[i % len(WORDS)] for i in range(700))  # longer than train.seq_len: split, kept
    _write_jsonl(text_dir / "a.jsonl", [{"text": long_doc}] + [{"text": f"document {i} {WORDS[i]}"}
                                                              for i in range(12)])
    _write_jsonl(text_dir / "b.jsonl", [{"text": f"other document {i}"} for i in range(12)])
    cases = {"messages": messages, "instruction": alpaca, "prompt_completion": tmp_path / "pc.parquet",
             "conversations": shards, "text": text_dir / "*.jsonl"}
    for name, path in cases.items():
        data = prepare(_spec(tmp_path / name, path, chat_tokenizer))
        assert data.stats["format"] == name
        tok = data.tokenizer()
        examples = [ex for split in ("train", "validation") for ex in data.examples(split)]
        rows = data.rows("train")
        if name == "text":
            assert len(examples) == 25 and data.stats["dropped"] == {}
            assert rows.loss_mask.sum() == data.stats["splits"]["train"]["loss_tokens"] > 700
            continue
        assert len(examples) == n and data.stats["dropped"] == {}, (name, data.stats)
        assert data.stats["splits"]["validation"]["examples"] == 4
        trained = tok.decode(rows.tokens[rows.loss_mask.astype(bool)])
        if name in ("messages", "conversations"):  # assistant turns with their end of turn, nothing else
            said = sorted(m["content"] for ex in data.examples("train") for m in ex.messages
                          if m["role"] == "assistant")
            assert sorted(trained.split("<|im_end|>")[:-1]) == said and trained.endswith("<|im_end|>")
        else:  # the answers with their end of turn (data.prompt_format: auto, a chat template), never the prompts
            answers = sorted(ex.answer.strip() for ex in data.examples("train"))
            assert sorted(a.strip() for a in trained.split("<|im_end|>")[:-1]) == answers, name


def test_splits_are_by_row_of_the_sizes_asked_and_group_by_keeps_groups_together(tmp_path):
    rows = [{"question": "Same instruction", "answer": f"answer {i}", "user": f"u{i % 5}"} for i in range(40)]
    path = _write_jsonl(tmp_path / "qa.jsonl", rows)
    data = prepare(small_spec(tmp_path, f"data.path={path}", "data.validation_size=2", "data.train_size=null",
                              "data.test_size=null"))
    assert data.stats["splits"]["validation"]["examples"] == 2  # not every row with a repeated question
    assert data.stats["splits"]["train"]["examples"] == 38 and data.stats["splits"]["test"]["examples"] == 0
    spec = small_spec(tmp_path / "g", f"data.path={path}", "data.validation_size=8", "data.train_size=null",
                      "data.test_size=null", "data.group_by=user")
    assert spec.data.test_size == 0  # nothing scores generations for data.task=none
    grouped = prepare(spec)
    answers = {s: {e.answer for e in grouped.examples(s)} for s in ("train", "validation")}
    users = {s: {rows[int(a.split()[1])]["user"] for a in answers[s]} for s in answers}
    assert not users["train"] & users["validation"] and len(answers["validation"]) == 8


@pytest.mark.parametrize(("rows", "extra", "match"), [
    ([{"prompt_text": "a", "reply": "b"}], (), r"columns \['prompt_text', 'reply'\].*messages: messages"),
    ([{"messages": [{"role": "user", "content": 3}]}], (), r"chat.jsonl:1.*content is a int, not text"),
    ([{"question": ["a"], "answer": "b"}], (), r"chat.jsonl:1.*question is a list, not text"),
    ([{"messages": [{"role": "robot", "content": "x"}]}], (), r"role 'robot'"),
    ([{"text": "x"}], ("data.format=messages",), r"data.format=messages needs the columns \['messages'\]"),
])
def test_bad_rows_are_named_errors(tmp_path, rows, extra, match):
    path = _write_jsonl(tmp_path / "chat.jsonl", rows * 30)
    with pytest.raises(DataError, match=match):
        preflight(small_spec(tmp_path, f"data.path={path}", *extra))


def test_a_conversation_needs_a_tokenizer_with_a_chat_template(tmp_path):
    plain = train_bpe([" ".join(WORDS)] * 5, 300)
    plain.save_pretrained(tmp_path / "tok")
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": _conversation(i)} for i in range(30)])
    with pytest.raises(DataError, match="no chat template") as e:
        preflight(small_spec(tmp_path, f"data.path={path}", f"model.tokenizer={tmp_path / 'tok'}"))
    assert e.value.where == "model.tokenizer"


def test_train_and_launch_refuse_bad_input_with_exit_2_before_a_run_directory_exists(tmp_path, chat_tokenizer):
    runs = tmp_path / "runs"
    chat = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": _conversation(i)} for i in range(30)])
    cases = [("model.path=/nonexistent/model", "model.path: /nonexistent/model does not exist"),
             (f"data.path={_write_jsonl(tmp_path / 'odd.jsonl', [{'a': 1}] * 5)}", "match no data format"),
             (f"data.path={chat}", "model.path: is unset, so shardline trains a byte-level BPE")]
    cases.append(("launch", cases[0][0], cases[0][1]))  # a detached local launch checks the same, first
    for verb, setting, message in [("train", *c) for c in cases[:3]] + cases[3:]:
        target = ["--target", "local"] if verb == "launch" else []
        out = run_cli(verb, *target, *[a for o in small_overrides(runs) for a in ("--set", o)], "--set", setting,
                      "--set", "data.validation_size=4", "--set", "data.test_size=0", timeout=120)
        assert out.returncode == 2 and message in out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
        assert not runs.exists() or not any(runs.iterdir()), list(runs.iterdir())


def test_prepare_shows_and_writes_the_rendered_examples_with_their_loss(tmp_path, chat_tokenizer):
    chat = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": _conversation(i)} for i in range(30)])
    sets = [*small_overrides(tmp_path / "runs"), f"data.path={chat}", f"model.tokenizer={chat_tokenizer}",
            "data.validation_size=4", "data.test_size=0", "data.train_size=null"]
    out = run_cli("prepare", *[a for o in sets for a in ("--set", o)], "--show", "2", "--json",
                  str(tmp_path / "shown.json"), timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.count("⟦") >= 4 and "<|im_start|>system" in out.stdout
    shown = json.loads((tmp_path / "shown.json").read_text())
    assert len(shown) == 2 and {s["split"] for s in shown} == {"train"} and shown[0]["source"] == "chat"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_tokenizer)
    for item in shown:
        messages = next(r["messages"] for r in map(json.loads, chat.read_text().splitlines())
                        if tok.apply_chat_template(r["messages"], tokenize=False) == item["text"])
        assert item["tokens"] == list(tok.apply_chat_template(messages, tokenize=True, return_dict=False))
        assert len(item["loss"]) == len(item["tokens"]) and 0 < sum(item["loss"]) < len(item["loss"])


def test_spec_errors_are_shardline_errors():
    assert issubclass(DataError, ShardlineError) and issubclass(SpecError, ShardlineError)


@pytest.mark.slow
def test_every_format_mixed_trains_on_two_ranks_resumes_exactly_and_exports(tmp_path, chat_tokenizer):
    """Seven sources, one per format (and layout; preference pairs train their chosen completion under SFT), on 2
    ranks: validation loss per source, sample generations
    beside their references in eval.json and the report, a resume from the step-3 checkpoint that trains steps 4-6 to
    the same losses, and an export whose tokenizer renders conversations as training did."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.conftest import only_run, read_metrics

    chat = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": _conversation(i, 1 + i % 2)} for i in range(60)])
    shards = tmp_path / "sharegpt"
    shards.mkdir()
    for k in range(2):
        _write_jsonl(shards / f"part-{k}.jsonl", [{"conversations": [{"from": "human", "value": f"hello {k} {i}?"},
                                                                     {"from": "gpt", "value": f"world {i}."}]}
                                                  for i in range(20)])
    pref = _write_jsonl(tmp_path / "pref.jsonl", [{"prompt": f"{WORDS[i % 5]} {i}? Yes or no:", "chosen": " yes",
                                                  "rejected": " no"} for i in range(30)])
    pc = tmp_path / "pc.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": f"{WORDS[i % 9]} {i}? Answer:", "completion": f" {WORDS[i % 7]}"}
                                         for i in range(30)]), pc)
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": f"translate {i}", "input": "good morning", "output": "bonjour"}
                                  for i in range(30)]))
    qa = _write_jsonl(tmp_path / "qa.jsonl", [{"question": f"how are you {i}", "answer": "today"} for i in range(30)])
    books = tmp_path / "books"
    books.mkdir()
    _write_jsonl(books / "a.jsonl", [{"text": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(20 + 9 * i))}
                                     for i in range(30)])
    sources = [(chat, 3), (shards, 1), (pref, 1), (pc, 1), (alpaca, 1), (qa, 1), (books / "*.jsonl", 1)]
    mixture = "data.sources=[" + ", ".join(f"{{path: '{path}', weight: {w}}}" for path, w in sources) + "]"
    runs = tmp_path / "runs"
    sets = [*small_overrides(runs), mixture, f"model.tokenizer={chat_tokenizer}", "data.test_size=null",
            "data.validation_size=4", "train.max_steps=6", "checkpoint.every_steps=3", "train.eval_every=3",
            "train.sample_generations=6", "train.eval_max_new_tokens=8", "observe.report=true"]
    out = run_cli("train", *[a for o in sets for a in ("--set", o)], "--nproc", "2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = only_run(runs)
    full = read_metrics(run, "train")
    assert [r["step"] for r in full] == [1, 2, 3, 4, 5, 6] and full[-1]["loss"] < full[0]["loss"]
    names = ["chat", "sharegpt", "pref", "pc", "alpaca", "qa", "books"]
    setup = next(e for e in read_metrics(run, "event") if e["event"] == "setup")
    assert [s["name"] for s in setup["data_sources"]] == names
    assert [s["format"] for s in setup["data_sources"]] == list(FORMATS)
    evals = [e for e in read_metrics(run, "eval") if "val_loss" in e]
    assert list(evals[-1]["val_loss_by_source"]) == names
    samples = json.loads((run / "eval.json").read_text())["samples"]
    assert [s["source"] for s in samples] == names[:6]  # sources in turn; raw text asks nothing
    assert samples[0]["question"].endswith("<|im_start|>assistant\n") and samples[0]["gold"].startswith("answer ")
    assert samples[1]["gold"].startswith("world ") and samples[2]["gold"] == " yes"
    assert samples[3]["gold"].strip() in WORDS
    assert [s["gold"] for s in samples[4:]] == ["bonjour", "today"] and all(s["pred"] is not None for s in samples)
    report = (run / "report" / "index.html").read_text()
    assert "Data sources" in report and all(f"<td>{n}</td>" in report for n in names)

    # a kill during the final save: step 6 never committed, steps 4-6 are trained again from step 3
    (run / "checkpoints" / "step-00000006" / "COMMITTED").unlink()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(ln for ln in lines if not any(
        f'"step": {s},' in ln or f'"step": {s}}}' in ln for s in (4, 5, 6))) + "\n")
    out = run_cli("train", str(run), "--nproc", "2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    resumed = read_metrics(run, "train")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(full[3:], resumed[3:], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)

    from shardline.cli import main  # in this process: its imports are paid already, a process would pay them again

    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf")
    messages = _conversation(0, 2)
    assert exported.apply_chat_template(messages, tokenize=True, return_dict=False) == \
        render_chat(AutoTokenizer.from_pretrained(chat_tokenizer), messages).ids
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.vocab_size == 512


def test_docs_show_every_formats_example_row():
    from tests.conftest import REPO

    doc = (REPO / "docs" / "data.md").read_text()
    for name, fmt in FORMATS.items():
        assert f"### `{name}`" in doc and json.dumps(fmt.example, ensure_ascii=False) in doc, name
        assert fmt.read(fmt.example, small_spec(Path("/tmp")).data.columns).kind in ("chat", "text", "prompt_answer")


def test_preference_rows_tokenize_as_trls_dpo_trainer(chat_tokenizer, tmp_path):
    """TRL's DPOTrainer prepares the same pairs: shardline's chosen and rejected documents are TRL's prompt ids
    followed by its chosen (rejected) ids, and the loss-bearing tokens are TRL's completion tokens (shardline adds
    one BOS to a plain prompt, as for prompt_completion)."""
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(chat_tokenizer)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    plain = [{"prompt": f"{WORDS[i]} question {i}? Answer:", "chosen": f" {WORDS[i + 1]} answer {i}.",
              "rejected": f" {WORDS[i + 2]} other {i} answer."} for i in range(4)]
    chats = [{"prompt": _conversation(i, 1)[:2], "chosen": _conversation(i, 1)[2:],
              "rejected": [{"role": "assistant", "content": f"wrong {WORDS[i]} {i}."}]} for i in range(4)]
    fmt, template = FORMATS["preference"], get_task("none").prompt
    for rows in (plain, chats):
        trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model), processing_class=tok,
                             train_dataset=Dataset.from_list(rows),
                             args=DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True))
        for row, theirs in zip(rows, trainer.train_dataset, strict=True):
            ex = fmt.read(row, small_spec(tmp_path).data.columns)
            for doc, completion in zip(ex.chosen_and_rejected(), ("chosen_ids", "rejected_ids"), strict=True):
                r = render(tok, doc, template, "plain")
                ids, loss = (r.ids[1:], r.loss[1:]) if isinstance(row["prompt"], str) else (r.ids, r.loss)
                if isinstance(row["prompt"], str):
                    assert r.ids[0] == tok.bos_token_id
                assert ids == theirs["prompt_ids"] + theirs[completion]
                trl_loss = [0] * len(theirs["prompt_ids"]) + [1] * len(theirs[completion])
                assert loss == trl_loss, (completion, row)


@pytest.mark.parametrize(("row", "reason"), [
    ({"prompt": "q", "chosen": " a", "rejected": " a"}, "chosen_equals_rejected"),
    ({"prompt": "q", "chosen": " ", "rejected": " b"}, "empty"),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}],
      "rejected": [{"role": "assistant", "content": "a"}]}, "chosen_equals_rejected"),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "b"}]}, "no_assistant_turn"),
])
def test_preference_rows_that_prefer_nothing_are_counted_drops(row, reason, tmp_path):
    from shardline.data.formats import RowProblem

    with pytest.raises(RowProblem) as e:
        FORMATS["preference"].read(row, small_spec(tmp_path).data.columns)
    assert e.value.reason == reason


def test_show_renders_both_documents_of_a_pair_under_dpo_and_the_chosen_under_sft(tmp_path):
    from shardline.data.preview import rendered

    tok = train_bpe(["Capital of France? Answer: Paris. Lyon."], 300)
    ex = FORMATS["preference"].read(FORMATS["preference"].example, small_spec(tmp_path).data.columns)
    dpo = rendered(tok, [("train", ex)], small_spec(tmp_path, "train.objective=dpo", "data.format=preference"))
    assert [item["pair"] for item in dpo] == ["chosen", "rejected"]
    assert [tok.decode([t for t, w in zip(item["tokens"], item["loss"], strict=True) if w]) for item in dpo] == \
        [" Paris." + tok.eos_token, " Lyon." + tok.eos_token]
    sft = rendered(tok, [("train", ex)], small_spec(tmp_path))
    assert len(sft) == 1 and "pair" not in sft[0] and sft[0]["tokens"] == dpo[0]["tokens"]
