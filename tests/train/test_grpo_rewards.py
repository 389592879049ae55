"""GRPO's rewards: the built-in text-to-SQL reward on the generated set's own databases and test suites, and a
user's `module:function` called as TRL calls a reward function, every bad return a named error."""

from __future__ import annotations

import sys

import pytest

from shardline.errors import ShardlineError, SpecError
from shardline.spec import DataSpec
from shardline.tasks import get_task
from shardline.tasks.text_to_sql import generated_splits
from shardline.training.rewards import reward_function

DATA = DataSpec(train_size=40, validation_size=8, test_size=8)


def test_the_sql_reward_is_suite_execution_match_plus_a_tenth_for_a_query_that_runs():
    ex = generated_splits(DATA)["train"][0]
    reward = reward_function("auto", get_task("text_to_sql"), DATA)
    wrong_but_runs = "SELECT 1 FROM " + ex.context.split("CREATE TABLE ")[1].split()[0]
    found = reward([ex] * 4, ["p"] * 4, [ex.answer, f"  {ex.answer} ;", wrong_but_runs, "DROP TABLE x"])
    assert found.values == [1.1, 1.1, 0.1, 0.0]  # spacing and a closing semicolon do not matter: execution does
    assert found.solved == [True, True, False, False]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length(prompts, completions, answer, question, **rest):\n"
        "    assert len(answer) == len(completions) and 'db_id' in rest and 'context' in rest\n"
        "    return [len(c) / 10 for c in completions]\n"
        "def raises(prompts, completions, **_):\n    raise KeyError('solution')\n"
        "def short(prompts, completions, **_):\n    return [1.0]\n"
        "def none(prompts, completions, **_):\n    return [None] * len(completions)\n"
        "def nan(prompts, completions, **_):\n    return [float('nan')] * len(completions)\n"
        "def flags(prompts, completions, **_):\n    return [c == 'ok' for c in completions]\n"
        "NOT_A_FUNCTION = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_rewards", None)


def test_a_users_reward_function_gets_prompts_completions_and_the_rows_columns(user_module):
    ex = generated_splits(DATA)["train"][0]
    task = get_task("none")
    assert reward_function("my_rewards:length", task, DATA)([ex, ex], ["p", "p"], ["abc", "abcdefghij"]).values == \
        [0.3, 1.0]
    assert reward_function("my_rewards:flags", task, DATA)([ex, ex], ["p", "p"], ["ok", "no"]).values == [1.0, 0.0]


@pytest.mark.parametrize(("name", "message"), [
    ("my_rewards:raises", "my_rewards:raises raised KeyError: 'solution'"),
    ("my_rewards:short", "returned 1 values for 2 completions"),
    ("my_rewards:none", "returned None for completion 0"),
    ("my_rewards:nan", "returned nan for completion 0"),
])
def test_a_reward_function_that_raises_or_returns_a_non_number_is_a_named_error(user_module, name, message):
    ex = generated_splits(DATA)["train"][0]
    with pytest.raises(ShardlineError, match="train.grpo.reward") as err:
        reward_function(name, get_task("none"), DATA)([ex, ex], ["p", "p"], ["a", "b"])
    assert message in str(err.value)


def test_a_reward_that_cannot_be_found_is_refused_at_setup(user_module):
    with pytest.raises(SpecError, match="module no_such_module, which does not import"):
        reward_function("no_such_module:f", get_task("none"), DATA)
    with pytest.raises(SpecError, match="NOT_A_FUNCTION, which module my_rewards does not define as a function"):
        reward_function("my_rewards:NOT_A_FUNCTION", get_task("none"), DATA)
    with pytest.raises(SpecError, match="data.task=none has no built-in reward"):
        reward_function("auto", get_task("none"), DATA)
