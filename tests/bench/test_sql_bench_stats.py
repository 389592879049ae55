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
