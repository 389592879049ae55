"""Nothing trained that the user did not mean (issue 52): a row's tool calls, tool results, offered tools, content
parts, extra turn keys, per-turn weights and system column all reach the chat template; the loss is on what the
assistant says (its calls and its answers), never on a tool's result; a template that cannot render a tool call is a
named error, never an empty turn; empty assistant turns are counted drops in every format; answers are kept as
written. Checked against transformers' `apply_chat_template(..., tools=..., return_assistant_tokens_mask=True)`."""

from __future__ import annotations

import copy
import json

import pytest

from shardline.data.formats import FORMATS, RowProblem
from shardline.data.preflight import preflight
from shardline.data.render import render
from shardline.data.tokenizer import train_bpe
from shardline.errors import DataError
from shardline.spec import ColumnsSpec
from shardline.tasks import get_task
from tests.conftest import small_spec

# ChatML with Qwen2.5's tool layout (tools in the system turn, calls as <tool_call> JSON, results as
# <tool_response>) and transformers' generation markers around all an assistant says: its reasoning, content,
# calls and end of turn.
TOOL_CHATML = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}"
    "{{ message.content }}{% for call in message.tool_calls or [] %}"
    "<tool_call>{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}"
    "</tool_call>{% endfor %}<|im_end|>{% endgeneration %}"
    "{{ '\\n' }}"
    "{% elif message.role == 'tool' %}<|im_start|>tool\n<tool_response>{{ message.content }}</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen2.5-Instruct's published template (no generation markers): the calls follow the content in the same turn.
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501 - as published
# ChatML that knows nothing of tools: it renders a tool-calling turn as its (empty) content.
PLAIN_CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _openai_row(content=None, arguments: object = '{"city": "Paris"}') -> dict:
    """A tool-using conversation as OpenAI's API writes it: the call's arguments a JSON string, its content null."""
    return {"messages": [
        {"role": "system", "content": "You help with the weather."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": content, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "It is sunny and 21 C in Paris."}], "tools": [WEATHER]}


def _as_template_sees_it(row: dict) -> list[dict]:
    """The row's messages as a template expects them: content text, arguments an object."""
    messages = copy.deepcopy(row["messages"])
    for m in messages:
        m["content"] = m.get("content") or ""
        for call in m.get("tool_calls", []):
            call["function"]["arguments"] = {"city": "Paris"}
    return messages


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    row = _openai_row()
    texts = [json.dumps(row)] * 10 + ["sunny weather in Paris tool_call tool_response think"] * 10
    tok = train_bpe(texts, 500)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = TOOL_CHATML
    path = tmp_path_factory.mktemp("tool-tokenizer")
    tok.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def _read(row: dict, fmt: str = "messages"):
    return FORMATS[fmt].read(row, ColumnsSpec())


def _render(tok, ex, assistant_turns: str = "all"):
    return render(tok, ex, get_task("none").prompt, "plain", assistant_turns)


def _trained_text(tok, r) -> str:
    return tok.decode([t for t, w in zip(r.ids, r.loss, strict=True) if w])


@pytest.mark.parametrize("content", [None, ""])
@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', {"city": "Paris"}])
def test_openai_tool_rows_render_their_calls_and_tools_with_transformers_ids_and_assistant_mask(
        tool_tokenizer, content, arguments):
    row = _openai_row(content, arguments)
    r = _render(tool_tokenizer, _read(row))
    theirs = tool_tokenizer.apply_chat_template(_as_template_sees_it(row), tools=row["tools"], tokenize=True,
                                                return_dict=True, return_assistant_tokens_mask=True)
    assert r.ids == list(theirs["input_ids"])
    assert r.loss == list(theirs["assistant_masks"])
    trained = _trained_text(tool_tokenizer, r)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>' in trained
    assert "It is sunny and 21 C in Paris.<|im_end|>" in trained
    assert "sunny, 21 C" not in trained and "The weather in a city now." not in trained  # results, tools: context
    assert "The weather in a city now." in tool_tokenizer.decode(r.ids)


@pytest.mark.parametrize("content", ["", "Let me look."])
def test_qwen25s_published_template_renders_tool_rows_with_the_loss_on_the_calls_and_the_answer(tool_tokenizer,
                                                                                                content):
    tok = copy.deepcopy(tool_tokenizer)
    tok.chat_template = QWEN25
    row = _openai_row(content)
    r = _render(tok, _read(row))
    assert r.ids == tok.apply_chat_template(_as_template_sees_it(row), tools=row["tools"], tokenize=True,
                                            return_dict=False)
    said = f"{content}\n" if content else ""
    assert _trained_text(tok, r) == (f'{said}<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}'
                                     "\n</tool_call><|im_end|>It is sunny and 21 C in Paris.<|im_end|>")


def test_tool_rows_tokenize_as_trls_sft_trainer(tool_tokenizer, tmp_path):
    """TRL's SFTTrainer (assistant-only loss, `tools` a JSON string column) prepares the same ids and loss."""
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tool_tokenizer), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    rows = []
    for content in ("", "Let me look."):
        row = _openai_row(content)
        rows.append({"messages": _as_template_sees_it(row), "tools": json.dumps(row["tools"])})
    trainer = SFTTrainer(model=model, processing_class=tool_tokenizer, train_dataset=Dataset.from_list(rows),
                         args=SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                        assistant_only_loss=True))
    for row, theirs in zip(rows, trainer.train_dataset, strict=True):
        r = _render(tool_tokenizer, _read(row))
        assert (r.ids, r.loss) == (theirs["input_ids"], [int(label != -100) for label in theirs["labels"]])


def test_trl_tool_calls_without_the_function_wrapper_read_as_openais(tool_tokenizer):
    """TRL's and many datasets' calls are `{"name", "arguments"}` objects: the same turn as OpenAI's form."""
    row = _openai_row("")
    bare = copy.deepcopy(row)
    bare["messages"][2]["tool_calls"] = [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    bare["tools"] = json.dumps(row["tools"])  # a JSON string, as datasets that keep one schema per column hold it
    a, b = _render(tool_tokenizer, _read(row)), _render(tool_tokenizer, _read(bare))
    assert '<tool_call>{"name": "get_weather"' in _trained_text(tool_tokenizer, b)
    assert (a.loss, tool_tokenizer.decode(a.ids).replace('"id": "call_1", ', "")) == \
        (b.loss, tool_tokenizer.decode(b.ids))


def test_a_template_that_cannot_render_tool_calls_is_a_named_error_not_an_empty_turn(tool_tokenizer, tmp_path):
    tok = copy.deepcopy(tool_tokenizer)
    tok.chat_template = PLAIN_CHATML
    with pytest.raises(DataError, match="tool call") as e:
        _render(tok, _read(_openai_row("")))
    assert "chat template" in e.value.where and "tool calls" in e.value.problem
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(_openai_row()) + "\n")
    tok.save_pretrained(tmp_path / "tok")
    with pytest.raises(DataError, match="tool call"):
        preflight(small_spec(tmp_path, f"data.path={path}", f"model.tokenizer={tmp_path / 'tok'}"))


def test_tool_results_and_weight_zero_turns_are_context_without_loss(tool_tokenizer):
    row = _openai_row("")
    row["messages"][2]["weight"] = 0  # the call is context: only the answer is learnt
    ex = _read(row)
    r = _render(tool_tokenizer, ex)
    trained = _trained_text(tool_tokenizer, r)
    assert trained == "It is sunny and 21 C in Paris.<|im_end|>"
    theirs = tool_tokenizer.apply_chat_template(_as_template_sees_it(row), tools=row["tools"], tokenize=True,
                                                return_dict=True, return_assistant_tokens_mask=True)
    assert r.ids == list(theirs["input_ids"]) and sum(r.loss) < sum(theirs["assistant_masks"])
    row["messages"][4]["weight"] = 0
    with pytest.raises(RowProblem) as e:
        _read(row)
    assert e.value.reason == "no_assistant_turn"


def test_content_part_lists_are_joined_into_text(tool_tokenizer):
    row = _openai_row("")
    row["messages"][1]["content"] = [{"type": "text", "text": "What is the weather"},
                                     {"type": "text", "text": "in Paris?"}]
    ex = _read(row)
    assert ex.messages[1]["content"] == "What is the weather\nin Paris?"
    row["messages"][1]["content"] = [{"type": "image_url", "image_url": {"url": "x.png"}}]
    with pytest.raises(RowProblem, match="image_url") as e:
        _read(row)
    assert e.value.reason == "not_text"


def test_extra_turn_keys_such_as_reasoning_content_reach_the_template_and_carry_loss(tool_tokenizer):
    row = _openai_row("")
    row["messages"][4]["reasoning_content"] = "The tool said sunny."
    r = _render(tool_tokenizer, _read(row))
    assert "<think>The tool said sunny.</think>It is sunny" in _trained_text(tool_tokenizer, r)
    plain = {"messages": [{"role": "user", "content": "Weather?"},
                          {"role": "assistant", "content": "Sunny.", "reasoning_content": "It is sunny."}]}
    r = _render(tool_tokenizer, _read(plain))
    theirs = tool_tokenizer.apply_chat_template(plain["messages"], tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
    assert (r.ids, r.loss) == (list(theirs["input_ids"]), list(theirs["assistant_masks"]))
    assert _trained_text(tool_tokenizer, r) == "<think>It is sunny.</think>Sunny.<|im_end|>"


def test_a_system_column_is_the_rows_system_prompt():
    row = {"system": "You answer in one word.", "conversations": [{"from": "human", "value": "Capital of France?"},
                                                                   {"from": "gpt", "value": "Paris."}]}
    assert _read(row, "conversations").messages[0] == {"role": "system", "content": "You answer in one word."}
    row["conversations"].insert(0, {"from": "system", "value": "Be brief."})  # the conversation's own one wins
    assert [m["content"] for m in _read(row, "conversations").messages] == ["Be brief.", "Capital of France?",
                                                                           "Paris."]


def test_an_instruction_rows_system_column_comes_before_its_prompt(tool_tokenizer):
    """LLaMA-Factory's Alpaca layout: a system turn before the prompt (chat), its text and a blank line (plain)."""
    row = {"system": "You translate.", "instruction": "Translate to French.", "input": "Good morning",
           "output": "Bonjour"}
    ex = _read(row, "instruction")
    plain = render(tool_tokenizer, ex, get_task("none").prompt, "plain")
    assert tool_tokenizer.decode(plain.ids) == \
        "<|bos|>You translate.\n\nTranslate to French.\n\nGood morning\nBonjour<|eos|>"
    chat = render(tool_tokenizer, ex, get_task("none").prompt, "chat")
    assert tool_tokenizer.decode(chat.ids) == tool_tokenizer.apply_chat_template([
        {"role": "system", "content": "You translate."}, {"role": "user", "content": "Translate to French.\n\n"
         "Good morning"}, {"role": "assistant", "content": "Bonjour"}], tokenize=False)[:-1]  # the line break after
    assert _trained_text(tool_tokenizer, chat) == "Bonjour<|im_end|>"


def test_sharegpt_function_call_and_observation_turns_are_tool_calls_and_results(tool_tokenizer):
    """LLaMA-Factory's tool rows: `function_call` is the assistant's call (JSON), `observation` the tool's result,
    `tools` a JSON string of the functions offered."""
    row = {"conversations": [
        {"from": "system", "value": "You help with the weather."},
        {"from": "human", "value": "What is the weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": "sunny, 21 C"},
        {"from": "gpt", "value": "It is sunny and 21 C in Paris."}], "tools": json.dumps([WEATHER["function"]])}
    ex = _read(row, "conversations")
    assert ex.messages[2]["role"] == "assistant" and ex.messages[2]["tool_calls"][0]["function"] == \
        {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert ex.messages[3] == {"role": "tool", "content": "sunny, 21 C"} and ex.tools == [WEATHER["function"]]
    trained = _trained_text(tool_tokenizer, _render(tool_tokenizer, ex))
    assert '"get_weather"' in trained and "sunny, 21 C" not in trained


@pytest.mark.parametrize(("row", "fmt"), [
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  \n"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]}, "messages"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""},
                   {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]}, "messages"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": " "}]}, "conversations"),
    ({"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": ""}]},
     "prompt_completion"),
    ({"prompt": "q", "completion": "  "}, "prompt_completion"),
    ({"instruction": "q", "output": "\n"}, "instruction"),
    ({"question": "q", "answer": " "}, "question_answer"),
])
def test_empty_assistant_turns_are_counted_drops_in_every_format(row, fmt):
    with pytest.raises(RowProblem) as e:
        _read(row, fmt)
    assert e.value.reason == "empty"


def test_an_assistant_turn_with_tool_calls_is_not_empty():
    turn = _read(_openai_row(""), "messages").messages[2]
    assert turn["content"] == "" and turn["tool_calls"][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize(("row", "fmt", "field"), [
    ({"instruction": "Write f.", "output": "    return x\n"}, "instruction", "answer"),
    ({"question": "Write f.", "answer": "    return x\n"}, "question_answer", "answer"),
    ({"prompt": "Write f.\n", "completion": "    return x\n"}, "prompt_completion", "answer"),
])
def test_answers_are_kept_as_written_in_every_format(row, fmt, field):
    """Leading indentation is code; nothing of an answer is trimmed."""
    assert getattr(_read(row, fmt), field) == "    return x\n"


@pytest.mark.parametrize(("turn", "match"), [
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]},
     "arguments"),
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}, "name"),
    ({"role": "assistant", "content": "a", "weight": 0.5}, "weight"),
])
def test_malformed_tool_calls_and_weights_are_named_row_errors(turn, match):
    row = {"messages": [{"role": "user", "content": "q"}, turn, {"role": "assistant", "content": "b"}]}
    with pytest.raises(RowProblem, match=match) as e:
        _read(row)
    assert e.value.reason == "not_a_conversation"  # an error naming the file and row, not a silent drop


def test_the_docs_tool_row_reads_with_its_call_and_tools():
    from tests.conftest import REPO

    line = next(x for x in (REPO / "docs" / "data.md").read_text().splitlines() if '"tool_calls"' in x and
                x.startswith("{"))
    ex = _read(json.loads(line))
    assert ex.messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert ex.tools and ex.tools[0]["function"]["name"] == "get_weather"


def test_data_roles_reads_turn_roles_of_other_names(tmp_path):
    spec = small_spec(tmp_path, "data.roles.bot=assistant", "data.roles.ipython=tool", "data.roles.call=function_call")
    row = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                        {"role": "call", "content": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
                        {"role": "ipython", "content": "sunny"}, {"role": "bot", "content": "Sunny."}]}
    ex = FORMATS["messages"].read(row, spec.data.columns, spec.data.roles)
    assert [m["role"] for m in ex.messages] == ["user", "assistant", "tool", "assistant"]
    assert ex.messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    with pytest.raises(RowProblem, match="role 'call'"):
        _read(row)  # without the map: an unknown role, named
    with pytest.raises(Exception, match="roles"):
        small_spec(tmp_path, "data.roles.bot=robot")


def test_openais_legacy_function_call_and_function_role_read_as_a_tool_call_and_result():
    row = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                        {"role": "assistant", "function_call": {"name": "get_weather",
                                                                "arguments": '{"city": "Paris"}'}},
                        {"role": "function", "name": "get_weather", "content": "sunny"},
                        {"role": "assistant", "content": "Sunny.", "tool_calls": []}]}
    ex = _read(row)
    assert ex.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert ex.messages[2] == {"role": "tool", "content": "sunny", "name": "get_weather"}
    assert ex.messages[3] == {"role": "assistant", "content": "Sunny."}


def test_data_roles_reach_the_rows_read_and_the_dataset_version(tmp_path):
    from shardline.data.prepare import dataset_version
    from shardline.data.sources import head_examples, open_sources

    path = tmp_path / "bot.jsonl"
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]}
    path.write_text(json.dumps(row) + "\n")
    sets = (f"data.path={path}", "data.validation_size=1", "data.test_size=0")
    mapped, other = small_spec(tmp_path, *sets, "data.roles.bot=assistant"), small_spec(tmp_path, *sets,
                                                                                       "data.roles.bot=user")
    assert head_examples(mapped.data, 1)[0].messages[1]["role"] == "assistant"
    assert dataset_version(mapped, open_sources(mapped.data)) != dataset_version(other, open_sources(other.data))


def test_tool_rows_prepare_with_their_calls_trained_and_empty_turns_counted(tool_tokenizer, tmp_path):
    """Through preparation: the prepared rows hold the tool rows' calls and answers as targets, the tools' results
    and the offered tools as context, and rows with an empty assistant turn are counted drops (`empty`)."""
    from shardline.data.prepare import prepare

    tool_tokenizer.save_pretrained(tmp_path / "tok")
    empty = {"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": " "}]}
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [_openai_row(None)] * 12 + [empty] * 3))
    data = prepare(small_spec(tmp_path, f"data.path={path}", f"model.tokenizer={tmp_path / 'tok'}",
                              "data.validation_size=2", "data.test_size=0", "data.train_size=null"))
    assert data.stats["dropped"] == {"empty": 3}
    rows = data.rows("train")
    tok = data.tokenizer()
    trained = tok.decode(rows.tokens[rows.loss_mask.astype(bool)])
    context = tok.decode(rows.tokens[~rows.loss_mask.astype(bool)])
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>'
    assert trained == (call + "It is sunny and 21 C in Paris.<|im_end|>") * 10
    assert context.count("sunny, 21 C") == 10 and context.count("The weather in a city now.") == 10
