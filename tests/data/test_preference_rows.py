"""Preference rows as people have them (issue 52), beside TRL's prompt/chosen/rejected: LLaMA-Factory's ShareGPT pairs
(a conversation ending with the user's turn, `chosen` and `rejected` one assistant turn each; also in OpenAI's
role/content form and with a `system` column), and Anthropic HH's two whole conversations (lists of turns, or HH's
"\\n\\nHuman: ... \\n\\nAssistant: ..." text) whose shared beginning is the prompt. Each is detected as
`data.format: auto` detects the others and read into the example TRL's form gives, so DPO trains on it unchanged.
TRL's `extract_prompt` (trl.data_utils), which DPOTrainer applies to rows without a prompt, is the oracle of the
shared prefix; the DPO paper's `extract_anthropic_prompt` that of HH's text."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from shardline.data.formats import FORMATS, RowProblem, detect
from shardline.data.preflight import preflight
from shardline.data.prepare import prepare
from shardline.data.render import render
from shardline.errors import DataError
from shardline.spec import ColumnsSpec
from shardline.tasks import get_task
from tests.conftest import small_spec
from tests.data.tokenizers import chatml_tokenizer

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['role'] == 'assistant' %}"
          "{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}\n{% else %}{{ message['content'] }}"
          "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
COLORS = ("blue", "green", "red", "grey", "black", "white")


def _read(row: dict):
    return FORMATS["preference"].read(row, ColumnsSpec())


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _hh_conversation(i: int, answer: str) -> list[dict]:
    """A conversation of 1 to 3 exchanges (sometimes with a system turn), ending with `answer`."""
    turns = [{"role": "system", "content": "You are brief."}] if i % 2 else []
    for t in range(i % 3):
        turns += [_user(f"Earlier question {t} of {i}?"), _assistant(f"Earlier answer {t}.")]
    return [*turns, _user(f"What color is sky {i}?"), _assistant(answer)]


def _hh_pair(i: int) -> dict:
    return {"chosen": _hh_conversation(i, f"It is {COLORS[i % 6]}."),
            "rejected": _hh_conversation(i, f"It is {COLORS[(i + 1) % 6]}, I think.")}


def _hh_text(turns: list[dict]) -> str:
    """A conversation as Anthropic's hh-rlhf writes it."""
    names = {"user": "Human", "assistant": "Assistant"}
    return "".join(f"\n\n{names[t['role']]}: {t['content']}" for t in turns)


def _hh_text_pair(i: int) -> dict:
    """The pair as hh-rlhf's text (which has no system turns)."""
    return {k: _hh_text([t for t in v if t["role"] != "system"]) for k, v in _hh_pair(i).items()}


def _sharegpt_pair(i: int) -> dict:
    """LLaMA-Factory's dpo_en_demo layout."""
    conversation = [{"from": "human", "value": f"Earlier question {i}?"}, {"from": "gpt", "value": "Earlier answer."},
                    {"from": "human", "value": f"What color is sky {i}?"}][2 - 2 * (i % 2):]
    return {"conversations": conversation, "chosen": {"from": "gpt", "value": f"It is {COLORS[i % 6]}."},
            "rejected": {"from": "gpt", "value": f"It is {COLORS[(i + 1) % 6]}, I think."}}


def _as_trl(row: dict) -> dict:
    """The same pair in TRL's conversational form."""
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    prompt = [{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"]]
    if "system" in row:
        prompt = [{"role": "system", "content": row["system"]}, *prompt]
    return {"prompt": prompt, "chosen": [_assistant(row["chosen"]["value"])],
            "rejected": [_assistant(row["rejected"]["value"])]}


def _as_openai(row: dict) -> dict:
    """LLaMA-Factory's ShareGPT pair with OpenAI's role/content tags (`messages`)."""
    roles = {"human": "user", "gpt": "assistant"}
    return {"messages": [{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"]],
            "chosen": _assistant(row["chosen"]["value"]), "rejected": _assistant(row["rejected"]["value"])}


@pytest.mark.parametrize("i", range(4))
def test_llamafactory_sharegpt_pairs_read_as_trls_conversational_pair(i):
    row = _sharegpt_pair(i)
    ex = _read(row)
    assert ex == _read(_as_trl(row)) and ex.preference and ex.kind == "chat"
    assert ex.messages[ex.trained_from:] == [_assistant(row["chosen"]["value"])]
    assert ex.rejected_turns == [_assistant(row["rejected"]["value"])]
    assert _read(_as_openai(row)) == ex


def test_a_sharegpt_pairs_system_column_is_its_system_prompt():
    row = {**_sharegpt_pair(0), "system": "You are brief."}
    ex = _read(row)
    assert ex.messages[0] == {"role": "system", "content": "You are brief."} and ex == _read(_as_trl(row))


@pytest.mark.parametrize("layout", ["sharegpt", "openai", "hh_turns", "hh_text", "trl"])
def test_auto_detects_every_preference_layout_as_the_preference_format(layout, tmp_path):
    """Rows with `chosen` and `rejected` are pairs, whatever holds their prompt: a `conversations` or `messages`
    column would otherwise read them as a conversation to fine-tune on."""
    pair = _sharegpt_pair(0)
    row = {"sharegpt": pair, "openai": _as_openai(pair), "hh_turns": _hh_pair(0),
           "hh_text": _hh_text_pair(0), "trl": _as_trl(pair)}[layout]
    assert detect(row, small_spec(tmp_path).data, "rows.jsonl:1").name == "preference"


@pytest.mark.parametrize("i", range(6))
def test_hh_conversation_pairs_split_at_trls_extracted_prompt(i):
    from trl.data_utils import extract_prompt, maybe_extract_prompt

    row = _hh_pair(i)
    ex = _read(row)
    theirs = extract_prompt(copy.deepcopy(row))
    assert ex == _read(theirs)
    assert ex.messages[: ex.trained_from] == theirs["prompt"] and ex.rejected_turns == theirs["rejected"]
    # a prompt column in text beside whole conversations (UltraFeedback's layout) is ignored, as TRL ignores it
    with_text_prompt = {"prompt": f"What color is sky {i}?", **row}
    assert _read(with_text_prompt) == ex == _read(maybe_extract_prompt(copy.deepcopy(with_text_prompt)))


def test_hh_conversation_pairs_in_sharegpt_turns_read_the_same():
    row = _hh_pair(2)
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    sharegpt = {k: [{"from": names[t["role"]], "value": t["content"]} for t in v] for k, v in row.items()}
    assert _read(sharegpt) == _read(row)


def _extract_anthropic_prompt(prompt_and_response: str) -> str:
    """The DPO paper's reading of hh-rlhf (eric-mitchell/direct-preference-optimization, preference_datasets.py):
    the prompt is the text up to and including the last "\\n\\nAssistant:"."""
    search_term = "\n\nAssistant:"
    search_term_idx = prompt_and_response.rfind(search_term)
    assert search_term_idx != -1, f"Prompt and response does not contain '{search_term}'"
    return prompt_and_response[: search_term_idx + len(search_term)]


@pytest.mark.parametrize("i", range(6))
def test_hh_text_pairs_split_before_the_last_assistant_answer(i):
    """The prompt is the shared text up to the last `\\n\\nAssistant:`, the answers what follows it (as the DPO paper
    reads hh-rlhf); TRL's character-wise `extract_prompt` cuts inside the answers where they first differ, at a
    longer prompt whose concatenations with its answers are the same texts."""
    from trl.data_utils import extract_prompt

    turns, row = _hh_pair(i), _hh_text_pair(i)
    ex = _read(row)
    assert ex.kind == "prompt_answer" and ex.preference
    assert ex.prompt == _extract_anthropic_prompt(row["chosen"]) == _extract_anthropic_prompt(row["rejected"])
    assert (ex.answer, ex.rejected) == (row["chosen"][len(ex.prompt):], row["rejected"][len(ex.prompt):])
    assert ex.answer == f" {turns['chosen'][-1]['content']}"
    theirs = extract_prompt(dict(row))
    assert theirs["prompt"].startswith(ex.prompt)
    assert (ex.prompt + ex.answer, ex.prompt + ex.rejected) == \
        (theirs["prompt"] + theirs["chosen"], theirs["prompt"] + theirs["rejected"])


def _differ_earlier() -> dict:
    row = _hh_pair(2)
    row["rejected"][1] = _assistant("Another earlier answer.")
    return row


def _hh_text_differ_earlier() -> dict:
    return {k: _hh_text(v) for k, v in _differ_earlier().items()}


@pytest.mark.parametrize(("row", "match"), [
    (_differ_earlier(), "differ before their last assistant turn"),
    ({"chosen": [_user("q"), _assistant("a")], "rejected": [_user("q"), _assistant("b"), _user("more?")]},
     "end with an assistant turn"),
    ({"chosen": [_user("q"), _assistant("a")], "rejected": [_user("other q"), _assistant("b")]},
     "differ before their last assistant turn"),
    (_hh_text_differ_earlier(), "differ before their last assistant turn"),
    ({"chosen": "It is blue.", "rejected": "It is green."}, "Assistant:"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
      "chosen": {"from": "gpt", "value": "b"}, "rejected": {"from": "gpt", "value": "c"}}, "ends with"),
    ({"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": "human", "value": "b"},
      "rejected": {"from": "gpt", "value": "c"}}, "assistant"),
    ({"messages": [_user("q")], "chosen": 3, "rejected": _assistant("c")}, "chosen"),
])
def test_pairs_that_are_not_one_prompt_with_two_answers_are_named_row_errors(row, match):
    with pytest.raises(RowProblem, match=match) as e:
        _read(row)
    assert e.value.reason == "not_a_conversation"  # an error naming the file and row, never a silent drop


@pytest.mark.parametrize(("row", "reason"), [
    ({"chosen": [_user("q"), _assistant("a")], "rejected": [_user("q"), _assistant("a")]}, "chosen_equals_rejected"),
    ({"chosen": "\n\nHuman: q\n\nAssistant: a", "rejected": "\n\nHuman: q\n\nAssistant: a"},
     "chosen_equals_rejected"),
    ({"chosen": "\n\nHuman: q\n\nAssistant: ", "rejected": "\n\nHuman: q\n\nAssistant: b"}, "empty"),
    ({"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": "gpt", "value": " "},
      "rejected": {"from": "gpt", "value": "c"}}, "empty"),
    ({"messages": [_user("q")], "chosen": _assistant("same"), "rejected": _assistant("same")},
     "chosen_equals_rejected"),
])
def test_pairs_that_prefer_nothing_are_counted_drops_in_every_layout(row, reason):
    with pytest.raises(RowProblem) as e:
        _read(row)
    assert e.value.reason == reason


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> Path:
    texts = [json.dumps(_hh_pair(i)) for i in range(12)] * 4
    return chatml_tokenizer(texts, 400, CHATML, tmp_path_factory.mktemp("pair-tokenizer"))


def test_hh_conversation_pairs_tokenize_as_trls_dpo_trainer(chat_tokenizer, tmp_path):
    """DPOTrainer extracts the prompt of rows without one itself: its prompt, chosen and rejected ids are shardline's
    two documents, with the loss on its completion tokens."""
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(chat_tokenizer)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    rows = [_hh_pair(i) for i in range(4)]
    trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model), processing_class=tok,
                         train_dataset=Dataset.from_list(rows),
                         args=DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True))
    for row, theirs in zip(rows, trainer.train_dataset, strict=True):
        for doc, completion in zip(_read(row).chosen_and_rejected(), ("chosen_ids", "rejected_ids"), strict=True):
            r = render(tok, doc, get_task("none").prompt, "plain")
            assert r.ids == theirs["prompt_ids"] + theirs[completion]
            assert r.loss == [0] * len(theirs["prompt_ids"]) + [1] * len(theirs[completion])


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("layout", ["hh_turns", "hh_text", "openai"])
def test_each_layout_prepares_as_dpo_pairs(layout, chat_tokenizer, tmp_path):
    rows = {"hh_turns": [_hh_pair(i) for i in range(12)],
            "hh_text": [_hh_text_pair(i) for i in range(12)],
            "openai": [_as_openai(_sharegpt_pair(i)) for i in range(12)]}[layout]
    path = _write(tmp_path / "pairs.jsonl", rows)
    data = prepare(small_spec(tmp_path, f"data.path={path}", f"model.tokenizer={chat_tokenizer}",
                              "train.objective=dpo", "data.train_size=null", "data.validation_size=2",
                              "data.test_size=0"))
    assert data.stats["format"] == "preference" and data.stats["dropped"] == {}, data.stats
    examples = data.examples("train") + data.examples("validation")
    assert len(examples) == 12 and all(ex.preference for ex in examples)
    assert sorted(json.dumps(ex.to_dict(), sort_keys=True) for ex in examples) == \
        sorted(json.dumps({**_read(row).to_dict(), "source": "pairs"}, sort_keys=True) for row in rows)


def test_a_pair_whose_conversations_differ_early_is_an_error_naming_the_row(tmp_path):
    path = _write(tmp_path / "pairs.jsonl", [_hh_pair(i) for i in range(3)] + [_differ_earlier()])
    with pytest.raises(DataError, match="differ before their last assistant turn") as e:
        preflight(small_spec(tmp_path, f"data.path={path}", "data.train_size=null", "data.validation_size=1",
                             "data.test_size=0"))
    assert "pairs.jsonl:4" in str(e.value)


def test_the_docs_preference_rows_read_as_the_pairs_they_show():
    from tests.conftest import REPO

    doc = (REPO / "docs" / "data.md").read_text()
    section = doc[doc.index("### `preference`"):doc.index("### `prompt_completion`")]
    rows = [json.loads(line) for line in section.splitlines() if line.startswith("{")]
    assert len(rows) == 3
    for row in rows:
        first, second = _read(row).chosen_and_rejected()
        answers = [(ex.answer or ex.messages[-1]["content"]).strip() for ex in (first, second)]
        assert answers == ["Paris.", "Lyon."], row


def test_data_roles_name_the_turns_of_every_pair_layout(tmp_path):
    spec = small_spec(tmp_path, "data.roles.bot=assistant", "data.roles.person=user")
    sharegpt = {"conversations": [{"from": "person", "value": "q"}], "chosen": {"from": "bot", "value": "a"},
                "rejected": {"from": "bot", "value": "b"}}
    hh = {"chosen": [{"role": "person", "content": "q"}, {"role": "bot", "content": "a"}],
          "rejected": [{"role": "person", "content": "q"}, {"role": "bot", "content": "b"}]}
    expected = _read({"prompt": [_user("q")], "chosen": [_assistant("a")], "rejected": [_assistant("b")]})
    for row in (sharegpt, hh):
        assert FORMATS["preference"].read(row, spec.data.columns, spec.data.roles) == expected
