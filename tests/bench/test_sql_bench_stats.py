"""The paired comparison bench/dpo_sql.py and bench/grpo_sql.py print: questions gained and lost, McNemar's exact p."""

from __future__ import annotations

import pytest

from tests.conftest import bench_module


@pytest.fixture(scope="module")
def dpo_sql():
    return bench_module("dpo_sql")


def test_gained_and_lost_pair_the_same_test_questions(dpo_sql):
    before = {"samples": [{"match": m} for m in (True, True, False, False, True)]}
    after = {"samples": [{"match": m} for m in (True, False, True, True, True)]}
    assert dpo_sql.gained_and_lost(before, after) == (2, 1)
    with pytest.raises(ValueError):  # different test questions are not a paired comparison
        dpo_sql.gained_and_lost(before, {"samples": after["samples"][:4]})


def test_mcnemar_exact_p_is_the_two_sided_binomial_tail_of_the_discordant_questions(dpo_sql):
    assert dpo_sql.mcnemar_p(10, 0) == pytest.approx(2 / 2**10)  # every one of 10 the same way
    # 2 · P(X ≤ 9), X ~ Binomial(24, 1/2), summed by hand from the binomial coefficients
    tail = sum([1, 24, 276, 2024, 10626, 42504, 134596, 346104, 735471, 1307504]) / 2**24
    assert dpo_sql.mcnemar_p(15, 9) == pytest.approx(2 * tail) == dpo_sql.mcnemar_p(9, 15)
    assert dpo_sql.mcnemar_p(7, 7) == 1.0 and dpo_sql.mcnemar_p(0, 0) == 1.0


def test_the_partial_credit_reward_adds_bigram_overlap_to_the_built_in_sql_reward():
    """bench/sql_partial_reward.py through the user-function path GRPO calls (`train.grpo.reward`): a correct query
    scores 1.1 + 0.3, a wrong literal in a right query keeps most of the overlap, a query that does not run none."""
    from shardline.spec import DataSpec
    from shardline.tasks.text_to_sql import generated_splits
    from shardline.training.rewards import reward_function

    partial = bench_module("sql_partial_reward")
    ex = next(e for e in generated_splits(DataSpec(train_size=40, validation_size=8, test_size=8))["train"]
              if "'" in e.answer)
    wrong = ex.answer.replace("'", "'X", 1)
    reward = reward_function("bench_sql_partial_reward:reward", None, DataSpec())  # registered by bench_module
    values = reward([ex] * 3, ["p"] * 3, [ex.answer, wrong, "DROP TABLE x"]).values
    overlap = partial.bigram_overlap(wrong, ex.answer)
    assert values == pytest.approx([1.4, 0.1 + 0.3 * overlap, 0.0]) and 0.5 < overlap < 1
    assert partial.bigram_overlap("SELECT a FROM t", "select a from t") == 1.0  # keywords in any case
    assert partial.bigram_overlap("SELECT a FROM t WHERE b = 'X'", "SELECT a FROM t WHERE b = 'x'") < 1  # literals not
