"""Defaults that fit an instruct model (issue 52): chat rendering where the tokenizer has a chat template, Alpaca's
order, no BOS a tokenizer does not add, named templates, validation sized by the data, warnings for rows dropped as
too long and for placeholders left in the text, and templates that rewrite earlier turns."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from shardline.data.prepare import prepare
from shardline.data.render import render, render_chat
from shardline.data.sources import open_sources
from shardline.data.splits import assign
from shardline.data.template import encode_prompt
from shardline.data.tokenizer import load_tokenizer, train_bpe
from shardline.errors import DataError
from shardline.spec import DataSpec
from shardline.spec.resolve import load_spec
from shardline.tasks import get_task
from tests.conftest import small_spec

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN3_LIKE = (  # Qwen3's rule: an assistant turn before the last question is rendered without its reasoning
    "{% set ns = namespace(last_query=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% set content = m['content'] %}"
    "{% set reasoning = '' %}{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_query %}<think>\n{{ reasoning }}\n</think>\n\n{% endif %}{{ content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ("hello", "world", "how", "are", "you", "today", "the", "capital", "of", "France", "is", "Paris", "translate",
         "good", "morning", "bonjour")
NONE = get_task("none").prompt


def _tokenizer(path: Path, template: str | None) -> Path:
    """A byte-level BPE with ChatML's special tokens, with `template` as its chat template (None: none)."""
    tok = train_bpe([" ".join(WORDS)] * 20 + ["<think> reasoning </think> {{name}} question answer"] * 5, 400)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> Path:
    return _tokenizer(tmp_path_factory.mktemp("chatml"), CHATML)


@pytest.fixture(scope="module")
def bare_tokenizer(tmp_path_factory) -> Path:
    """ChatML's tokens, no chat template (a base model's tokenizer)."""
    return _tokenizer(tmp_path_factory.mktemp("bare"), None)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _pc_rows(n: int, long_every: int = 0) -> list[dict]:
    return [{"prompt": f"{WORDS[i % 9]} question {i}?",
             "completion": " " + " ".join(WORDS * (30 if long_every and i % long_every == 0 else 1))}
            for i in range(n)]


def _spec(tmp_path: Path, *extra: str):
    return small_spec(tmp_path, "data.validation_size=4", "data.test_size=0", "data.train_size=null", *extra)


def _first_ids(data) -> list[int]:
    rows = data.rows("train")
    return [int(t) for t in rows.tokens[0][: rows.n_real[0]]]


def test_auto_prompt_format_renders_chat_with_a_chat_template_and_says_which(tmp_path, chat_tokenizer):
    rows = _jsonl(tmp_path / "pc.jsonl", _pc_rows(24))
    data = prepare(_spec(tmp_path, f"data.path={rows}", f"model.tokenizer={chat_tokenizer}"))
    tok = data.tokenizer()
    assert tok.convert_tokens_to_ids("<|im_start|>") in _first_ids(data)
    assert data.stats["prompt_format"] == data.meta["prompt_format"] == "chat"
    plain = prepare(_spec(tmp_path / "plain", f"data.path={rows}"))  # the trained BPE has no chat template
    assert plain.stats["prompt_format"] == plain.meta["prompt_format"] == "plain"


def test_one_prompt_format_for_a_mixture_unless_a_source_says_otherwise(tmp_path, chat_tokenizer):
    a, b = _jsonl(tmp_path / "a.jsonl", _pc_rows(20)), _jsonl(tmp_path / "b.jsonl", _pc_rows(20))
    sources = f"data.sources=[{{path: {a}}}, {{path: {b}, prompt_format: plain, name: b}}]"
    data = prepare(_spec(tmp_path, sources, f"model.tokenizer={chat_tokenizer}"))
    assert [s["prompt_format"] for s in data.stats["sources"]] == ["chat", "plain"]


def test_alpaca_instruction_comes_before_its_input(chat_tokenizer):
    from shardline.data.formats import FORMATS

    tok = load_tokenizer(str(chat_tokenizer))
    ex = FORMATS["instruction"].read({"instruction": "Translate to French.", "input": "Good morning",
                                      "output": "Bonjour"}, DataSpec().columns)
    r = render(tok, ex, NONE, "plain")
    prompt = tok.decode([t for t, loss in zip(r.ids, r.loss, strict=True) if not loss], skip_special_tokens=True)
    assert prompt.strip() == "Translate to French.\n\nGood morning"


def _bos_tokenizer(adds_bos: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    t.train_from_iterator([" ".join(WORDS)] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if adds_bos:  # as Llama's and Mistral's tokenizers do
        t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("adds_bos", [False, True])
def test_a_plain_prompt_and_a_text_start_with_bos_only_where_the_tokenizer_adds_one(adds_bos):
    from shardline.data.render import text_ids

    tok = _bos_tokenizer(adds_bos)
    prompt = encode_prompt(tok, NONE, "hello world", "", "plain")
    assert (prompt[0] == tok.bos_token_id) is adds_bos and prompt.count(tok.bos_token_id) == int(adds_bos)
    assert (int(text_ids(tok, "hello world")[0]) == tok.bos_token_id) is adds_bos


def test_the_trained_tokenizer_keeps_its_bos():
    tok = train_bpe([" ".join(WORDS)] * 10, 300)
    assert encode_prompt(tok, NONE, "hello", "", "plain")[0] == tok.bos_token_id


def test_a_named_template_renders_for_a_tokenizer_without_one_with_transformers_assistant_mask(tmp_path,
                                                                                               bare_tokenizer):
    from shardline.data.named_templates import TEMPLATES

    conversation = [{"role": "user", "content": "hello world?"}, {"role": "assistant", "content": "Paris today."},
                    {"role": "user", "content": "how are you?"}, {"role": "assistant", "content": "good morning"}]
    rows = _jsonl(tmp_path / "chat.jsonl", [{"messages": conversation}] * 12)
    data = prepare(_spec(tmp_path, f"data.path={rows}", f"model.tokenizer={bare_tokenizer}",
                         "data.chat_template=chatml"))
    tok = data.tokenizer()
    assert tok.chat_template == TEMPLATES["chatml"].source
    ours = render_chat(tok, conversation)
    theirs = tok.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
    assert (ours.ids, ours.loss) == (theirs["input_ids"], theirs["assistant_masks"])
    trained = tok.decode([t for t, loss in zip(ours.ids, ours.loss, strict=True) if loss])
    assert trained == "Paris today.<|im_end|>good morning<|im_end|>"


def test_a_named_template_whose_tokens_the_tokenizer_lacks_is_refused_by_name(tmp_path, bare_tokenizer):
    rows = _jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hello?"},
                                                          {"role": "assistant", "content": "world"}]}] * 12)
    with pytest.raises(DataError) as err:
        prepare(_spec(tmp_path, f"data.path={rows}", f"model.tokenizer={bare_tokenizer}",
                      "data.chat_template=llama3"))
    assert "data.chat_template=llama3" in err.value.where and "<|eot_id|>" in err.value.problem


def test_the_alpaca_template_needs_only_eos_and_fits_the_trained_tokenizer(tmp_path):
    rows = _jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": f"hello {i}?"},
                                                          {"role": "assistant", "content": "world"}]}
                                            for i in range(12)])
    data = prepare(_spec(tmp_path, f"data.path={rows}", "data.chat_template=alpaca"))
    tok = data.tokenizer()
    ids = _first_ids(data)
    rows_ = data.rows("train")
    trained = [t for t, flag in zip(ids, rows_.loss_mask[0][: len(ids)], strict=True) if flag]
    assert "### Response:" in tok.decode(ids) and trained[-1] == tok.eos_token_id


def _rows_file(tmp_path: Path, n: int) -> Path:
    return _jsonl(tmp_path / f"qa{n}.jsonl", [{"question": f"q{i}", "answer": "a"} for i in range(n)])


@pytest.mark.parametrize(("rows", "validation"), [(10, 1), (100, 5), (1000, 50), (5000, 200)])
def test_validation_is_five_percent_of_a_users_rows_at_most_200(tmp_path, rows, validation):
    data = DataSpec(path=str(_rows_file(tmp_path, rows)))
    a = assign(open_sources(data)[0], 0, data)
    assert list(a.held.values()).count("validation") == validation


def test_an_explicit_validation_size_and_the_generated_sets_stay(tmp_path):
    data = DataSpec(path=str(_rows_file(tmp_path, 100)), validation_size=7)
    assert list(assign(open_sources(data)[0], 0, data).held.values()).count("validation") == 7
    assert DataSpec().validation_size == 200 and load_spec("tiny").data.validation_size == 200
    assert load_spec("tiny", [f"data.path={tmp_path / 'qa100.jsonl'}"]).data.validation_size is None


def test_many_rows_dropped_as_too_long_warn_with_the_seq_len_that_keeps_95_percent(tmp_path, caplog):
    rows = _jsonl(tmp_path / "pc.jsonl", _pc_rows(60, long_every=3))
    with caplog.at_level(logging.WARNING):
        data = prepare(_spec(tmp_path, f"data.path={rows}"))
    warning = next(r.getMessage() for r in caplog.records if "too_long" in r.getMessage())
    suggested = int(warning.split("train.seq_len=")[2].split()[0])
    longest = max(len(render(data.tokenizer(), ex, NONE, "plain").ids)
                  for ex in open_examples(rows))
    assert suggested % 64 == 0 and longest <= suggested < longest + 64
    assert "33%" in warning


def open_examples(path: Path):
    from shardline.data.formats import FORMATS

    return [FORMATS["prompt_completion"].read(json.loads(line), DataSpec().columns)
            for line in path.read_text().splitlines()]


def test_few_rows_dropped_as_too_long_do_not_warn(tmp_path, caplog):
    rows = _jsonl(tmp_path / "pc.jsonl", _pc_rows(60, long_every=20))
    with caplog.at_level(logging.WARNING):
        prepare(_spec(tmp_path, f"data.path={rows}"))
    assert not [r for r in caplog.records if "too_long" in r.getMessage()]


def test_placeholders_left_in_the_text_are_named_in_a_warning(tmp_path, caplog):
    identity = [{"instruction": "Who are you?", "input": "", "output": "I am {{name}}, trained by {{author}}."},
                {"instruction": "hi", "input": "", "output": "Hello! I am {{ name }}."},
                *({"instruction": f"q{i}", "input": "", "output": "a"} for i in range(20))]
    data = DataSpec(path=str(_jsonl(tmp_path / "identity.jsonl", identity)), validation_size=2)
    with caplog.at_level(logging.WARNING):
        assign(open_sources(data)[0], 0, data)
    warning = next(r.getMessage() for r in caplog.records if "placeholder" in r.getMessage())
    assert "{{name}} (2 rows)" in warning and "{{author}} (1 row)" in warning and "identity.jsonl" in warning


def test_no_placeholder_warning_for_plain_text(tmp_path, caplog):
    data = DataSpec(path=str(_rows_file(tmp_path, 30)), validation_size=3)
    with caplog.at_level(logging.WARNING):
        assign(open_sources(data)[0], 0, data)
    assert not [r for r in caplog.records if "placeholder" in r.getMessage()]


def test_a_template_that_drops_earlier_reasoning_is_masked_from_the_whole_conversation(tmp_path):
    tok = load_tokenizer(str(_tokenizer(tmp_path / "qwen3", QWEN3_LIKE)))
    conversation = [{"role": "user", "content": "hello?"},
                    {"role": "assistant", "content": "<think>reasoning one</think>world"},
                    {"role": "user", "content": "how are you?"},
                    {"role": "assistant", "content": "<think>reasoning two</think>good"}]
    r = render_chat(tok, conversation)
    assert r.ids == tok.encode(tok.apply_chat_template(conversation, tokenize=False), add_special_tokens=False)
    trained = tok.decode([t for t, loss in zip(r.ids, r.loss, strict=True) if loss])
    assert trained == "world<|im_end|><think>\nreasoning two\n</think>\n\ngood<|im_end|>"


def test_a_template_that_rewrites_turns_beyond_finding_them_is_refused_by_name(tmp_path):
    reversed_turns = "{% for m in messages | reverse %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tok = load_tokenizer(str(_tokenizer(tmp_path / "reversed", reversed_turns)))
    conversation = [{"role": "user", "content": "hello?"}, {"role": "assistant", "content": "<think>x</think>a"},
                    {"role": "user", "content": "how?"}, {"role": "assistant", "content": "<think>y</think>b"}]
    with pytest.raises(DataError) as err:
        render_chat(tok, [dict(m, reasoning_content="r") for m in conversation])
    assert str(tmp_path / "reversed") in err.value.where and "chat template" in err.value.where
