"""LLaMA-Factory's five demo data sets "prepare as they are and train one step" (issue 52): files in the layouts of
its alpaca_en_demo.json, glaive_toolcall_en_demo.json, identity.json, c4_demo.jsonl and dpo_en_demo.json (rows
written here in the same shapes) are read by `data.format: auto`, keep every row, and train one step in-process at
world 1 (dpo_en_demo under `train.objective: dpo`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from shardline.data.prepare import prepare
from shardline.training.trainer import Trainer
from tests.conftest import small_spec
from tests.data.test_tool_rows import TOOL_CHATML
from tests.data.tokenizers import chatml_tokenizer

CITIES = ("Paris", "Berlin", "Madrid", "Rome", "Vienna", "Lisbon", "Prague", "Dublin", "Oslo", "Athens")


def alpaca_en_demo() -> list[dict]:
    """A JSON array of instruction/input/output rows, `input` often empty."""
    return [{"instruction": f"Name the capital city of country number {i}.", "input": "" if i % 3 else "Europe",
             "output": f"The capital is {CITIES[i]}."} for i in range(10)]


def identity() -> list[dict]:
    """Alpaca rows about the assistant itself, with `{{name}}` and `{{author}}` left for the user to fill in."""
    asks = ("hi", "Who are you?", "What is your name?", "Who made you?", "Are you ChatGPT?", "hello",
            "Introduce yourself.", "Which company trained you?")
    return [{"instruction": ask, "input": "",
             "output": f"I am {{{{name}}}}, an assistant built by {{{{author}}}}. Question {i}: how can I help?"}
            for i, ask in enumerate(asks)]


def c4_demo() -> list[dict]:
    """Raw web text for continued pretraining, one `text` per line."""
    return [{"text": " ".join(f"{CITIES[(i + k) % 10]} is a city people visit in spring." for k in range(3 + i))}
            for i in range(10)]


RATE_TOOL = {"name": "get_exchange_rate", "description": "The exchange rate between two currencies.",
             "parameters": {"type": "object", "properties": {"base": {"type": "string"}, "target": {"type": "string"}},
                            "required": ["base", "target"]}}


def glaive_toolcall_en_demo() -> list[dict]:
    """ShareGPT conversations with `function_call` and `observation` turns, the tools a JSON string column; some rows
    offer a tool they never call."""
    rows = []
    for i in range(8):
        if i % 4 == 3:
            conversation = [{"from": "human", "value": f"Tell me about {CITIES[i]}."},
                            {"from": "gpt", "value": f"{CITIES[i]} is a city; I can only look up exchange rates."}]
        else:
            call = {"name": "get_exchange_rate", "arguments": {"base": "EUR", "target": f"C{i}"}}
            conversation = [
                {"from": "human", "value": f"How many C{i} is one euro?"},
                {"from": "function_call", "value": json.dumps(call)},
                {"from": "observation", "value": json.dumps({"rate": 1.5 + i})},
                {"from": "gpt", "value": f"One euro is {1.5 + i} C{i}."}]
        rows.append({"conversations": conversation, "tools": json.dumps([RATE_TOOL])})
    return rows


def dpo_en_demo() -> list[dict]:
    """ShareGPT pairs: a conversation ending with the user's turn, one assistant turn chosen and one rejected."""
    rows = []
    for i in range(10):
        conversation = [{"from": "human", "value": f"Which city is the capital of country {i}?"}]
        if i % 2:
            conversation = [{"from": "human", "value": "Can you answer questions about capitals?"},
                            {"from": "gpt", "value": "Yes, ask me."}, *conversation]
        rows.append({"conversations": conversation,
                     "chosen": {"from": "gpt", "value": f"It is {CITIES[i]}."},
                     "rejected": {"from": "gpt", "value": f"Perhaps {CITIES[(i + 1) % 10]}, or not."}})
    return rows


def _write_array(path: Path, rows: list[dict]) -> Path:
    path.write_text(json.dumps(rows, indent=2, ensure_ascii=False))
    return path


def _write_lines(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# name: (rows, written as, the format detected, needs a chat tokenizer, extra settings)
LAYOUTS = {
    "alpaca_en_demo.json": (alpaca_en_demo, _write_array, "instruction", False, ()),
    "glaive_toolcall_en_demo.json": (glaive_toolcall_en_demo, _write_array, "conversations", True,
                                     ("train.seq_len=384", "model.arch.max_position_embeddings=384")),
    "identity.json": (identity, _write_array, "instruction", False, ()),
    "c4_demo.jsonl": (c4_demo, _write_lines, "text", False, ()),
    "dpo_en_demo.json": (dpo_en_demo, _write_array, "preference", True, ("train.objective=dpo",)),
}


@pytest.fixture(scope="module")
def tool_chat_tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE with ChatML's special tokens and a template that renders tool calls, results and tools."""
    texts = ([json.dumps(make()) for make, *_ in LAYOUTS.values()] + [json.dumps(RATE_TOOL)]) * 5
    return chatml_tokenizer(texts, 500, TOOL_CHATML, tmp_path_factory.mktemp("llamafactory-tokenizer"))


def _prepared(name: str, tmp_path: Path, tokenizer: Path):
    make, write, fmt, chat, extra = LAYOUTS[name]
    rows = make()
    path = write(tmp_path / name, rows)
    spec = small_spec(tmp_path, f"data.path={path}", "data.train_size=null", "data.validation_size=2",
                      "data.test_size=0", "train.peak_tflops=1", "checkpoint.async_save=false",
                      *([f"model.tokenizer={tokenizer}"] if chat else []), *extra)
    return rows, fmt, spec, prepare(spec)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_llamafactory_demo_layouts_prepare_as_they_are_and_train_one_step(name, ctx, tmp_path, tool_chat_tokenizer):
    rows, fmt, spec, data = _prepared(name, tmp_path, tool_chat_tokenizer)
    assert data.stats["format"] == fmt and data.stats["dropped"] == {}, data.stats
    examples = data.examples("train") + data.examples("validation")
    if fmt == "text":  # a document longer than train.seq_len would be split, never dropped; these all fit
        assert sorted(ex.text for ex in examples) == sorted(r["text"] for r in rows)
    else:
        assert len(examples) == len(rows) and data.stats["splits"]["validation"]["examples"] == 2
    assert all(ex.preference for ex in examples) == (fmt == "preference")

    trainer = Trainer(spec, ctx, data, tmp_path / "run", Console(quiet=True))
    trainer.begin()
    record = trainer.train_step()
    assert math.isfinite(record.loss) and record.grad_norm > 0 and record.tokens > 0, record
    if fmt == "preference":  # the policy is the reference at the first step: Δ = 0
        assert record.preference["pairs"] > 0 and record.loss == pytest.approx(math.log(2), abs=1e-5)


def _trained_text(data) -> str:
    rows, tok = data.rows("train"), data.tokenizer()
    return tok.decode(rows.tokens[rows.loss_mask.astype(bool)])


def test_identity_placeholders_are_trained_as_written(tmp_path, tool_chat_tokenizer):
    """`{{name}}` and `{{author}}` are the user's to replace before training (LLaMA-Factory's README); shardline
    neither fills nor strips them."""
    _, _, _, data = _prepared("identity.json", tmp_path, tool_chat_tokenizer)
    assert all("{{name}}" in ex.answer and "{{author}}" in ex.answer for ex in data.examples("train"))
    trained = _trained_text(data)
    assert trained.count("{{name}}") == trained.count("{{author}}") == len(data.examples("train"))


def test_glaive_tool_calls_carry_loss_and_the_tools_column_reaches_the_template(tmp_path, tool_chat_tokenizer):
    _, _, _, data = _prepared("glaive_toolcall_en_demo.json", tmp_path, tool_chat_tokenizer)
    examples = data.examples("train")
    assert all(ex.tools == [RATE_TOOL] for ex in examples)
    calls = [m for ex in examples for m in ex.messages if m.get("tool_calls")]
    assert calls and all(m["role"] == "assistant" and m["tool_calls"][0]["function"]["name"] == "get_exchange_rate"
                         for m in calls)
    trained = _trained_text(data)
    assert trained.count('<tool_call>{"name": "get_exchange_rate", "arguments": {"base": "EUR"') == len(calls)
    assert '"rate"' not in trained and "exchange rate between two currencies" not in trained  # results, tools: context
    rows = data.rows("train")
    assert "exchange rate between two currencies" in data.tokenizer().decode(rows.tokens[rows.tokens >= 0])


def test_dpo_en_demo_trains_its_chosen_answers_under_sft(tmp_path, tool_chat_tokenizer):
    """The usual step before DPO: the same file under `train.objective: sft` trains each pair's chosen answer."""
    make, write, *_ = LAYOUTS["dpo_en_demo.json"]
    rows = make()
    path = write(tmp_path / "dpo_en_demo.json", rows)
    data = prepare(small_spec(tmp_path, f"data.path={path}", "data.train_size=null", "data.validation_size=2",
                              "data.test_size=0", f"model.tokenizer={tool_chat_tokenizer}"))
    assert data.stats["format"] == "preference" and data.stats["dropped"] == {}, data.stats
    trained = _trained_text(data)
    chosen = {r["chosen"]["value"] for r in rows}
    said = [t for t in trained.split("<|im_end|>")[:-1]]
    assert said and all(t in chosen for t in said) and "Perhaps" not in trained
