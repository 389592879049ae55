"""Test-suite SQL scoring: wrong queries that one database (or empty tables) lets through are caught, equivalent
ones still match, and the suite follows the schema, the context's rows and the gold's literals."""

import sqlite3

import pytest

from shardline.example import Example
from shardline.tasks.text_to_sql.execution import execution_match, run_sql
from shardline.tasks.text_to_sql.generate import generate_databases, generate_splits
from shardline.tasks.text_to_sql.score import SUITE_SIZE, score_predictions
from shardline.tasks.text_to_sql.suite import exact_match, suite_databases, suite_match
from shardline.training.evaluate import unique_questions

SHOP = """CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT, age INTEGER);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id), product VARCHAR(30),
                     price REAL, ordered DATE)"""
PARIS = "SELECT name FROM customers WHERE city = 'Paris'"


def _suite(gold: str, context: str = SHOP, n: int = 8, seed: int = 0) -> list[sqlite3.Connection]:
    return suite_databases(context, gold, n, seed)


def _rows(conn: sqlite3.Connection, sql: str) -> list[tuple]:
    return conn.execute(sql).fetchall()


def test_wrong_literal_matched_on_empty_tables_but_not_on_the_suite():
    pred = "SELECT name FROM customers WHERE city = 'Lyon'"
    empty = sqlite3.connect(":memory:")
    empty.executescript(SHOP)  # the old scoring for data without a database
    assert execution_match(empty, pred, PARIS)
    result = suite_match(_suite(PARIS), pred, PARIS)
    assert not result.match and result.databases == 8 and result.gold_errors == 0


@pytest.mark.parametrize("pred", [
    "SELECT name FROM customers WHERE name = 'Paris'",  # wrong column in the filter
    "SELECT city FROM customers WHERE city = 'Paris'",  # wrong column selected
    "SELECT name FROM customers WHERE city LIKE 'paris'",  # case-insensitive where the gold is not
    "SELECT name FROM customers WHERE city = 'Paris' AND age > 10",  # an extra filter
    "SELECT DISTINCT name FROM customers WHERE city = 'Paris'",  # duplicates dropped
])
def test_wrong_filter_or_selection_is_not_a_match(pred):
    assert not suite_match(_suite(PARIS), pred, PARIS).match


@pytest.mark.parametrize(("gold", "pred"), [
    ("SELECT MAX(age) FROM customers WHERE city = 'Paris'", "SELECT MIN(age) FROM customers WHERE city = 'Paris'"),
    ("SELECT AVG(price) FROM orders WHERE product = 'Desk'", "SELECT SUM(price) FROM orders WHERE product = 'Desk'"),
    ("SELECT COUNT(*) FROM customers WHERE age > 40", "SELECT COUNT(*) FROM customers WHERE age >= 40"),
    ("SELECT COUNT(*) FROM customers WHERE age > 40", "SELECT COUNT(age) FROM customers WHERE age > 41"),
    ("SELECT city, MAX(age) FROM customers GROUP BY city", "SELECT city, MIN(age) FROM customers GROUP BY city"),
    ("SELECT name FROM customers ORDER BY age DESC, id", "SELECT name FROM customers ORDER BY age ASC, id"),
    ("SELECT COUNT(*) FROM orders AS T1 JOIN customers AS T2 ON T1.customer_id = T2.id WHERE T2.city = 'Oslo'",
     "SELECT COUNT(*) FROM orders AS T1 JOIN customers AS T2 ON T1.id = T2.id WHERE T2.city = 'Oslo'"),
])
def test_wrong_aggregate_bound_order_or_join_is_not_a_match(gold, pred):
    assert not suite_match(_suite(gold), pred, gold).match


@pytest.mark.parametrize(("gold", "pred"), [
    ("SELECT T2.name FROM orders AS T1 JOIN customers AS T2 ON T1.customer_id = T2.id WHERE T1.price > 20",
     "SELECT c.name FROM orders AS o JOIN customers AS c ON o.customer_id = c.id WHERE o.price > 20"),
    ("SELECT name FROM customers WHERE age > 5", "SELECT name FROM customers WHERE 5 < age"),
    ("SELECT name FROM customers WHERE city = 'Paris' AND age < 30",
     "select name from customers where age < 30 and city = 'Paris';"),
    ("SELECT T2.name, T1.product FROM orders AS T1 JOIN customers AS T2 ON T1.customer_id = T2.id",
     "SELECT T2.name, T1.product FROM customers AS T2 JOIN orders AS T1 ON T2.id = T1.customer_id"),
    ("SELECT name FROM customers WHERE city IN ('Paris', 'Oslo')",
     "SELECT name FROM customers WHERE city = 'Oslo' OR city = 'Paris'"),
    ("SELECT COUNT(*) FROM customers WHERE age BETWEEN 30 AND 40",
     "SELECT COUNT(*) FROM customers WHERE age >= 30 AND age <= 40"),
])
def test_equivalent_rewrite_is_a_match(gold, pred):
    result = suite_match(_suite(gold), pred, gold)
    assert result.match and result.databases == 8


def test_gold_literals_are_in_the_data_so_the_gold_returns_rows():
    gold = "SELECT name FROM customers WHERE city = 'Paris' AND age > 40 AND name LIKE 'Jo%'"
    suite = _suite(gold)
    assert any(_rows(db, "SELECT 1 FROM customers WHERE city = 'Paris'") for db in suite)
    assert any(_rows(db, "SELECT 1 FROM customers WHERE age IN (40, 41)") for db in suite)
    assert suite_match(suite, gold, gold).gold_nonempty >= 2


def test_grouped_columns_draw_from_few_values_so_groups_hold_several_rows():
    suite = _suite("SELECT city, MAX(age) FROM customers GROUP BY city")
    biggest = "SELECT MAX(n) FROM (SELECT COUNT(*) AS n FROM customers GROUP BY city)"
    assert sum(_rows(db, biggest)[0][0] >= 2 for db in suite) >= 7  # else MAX and MIN per group agree


def test_rows_inserted_by_the_context_are_in_every_database():
    context = ("CREATE TABLE cities (name TEXT PRIMARY KEY, country TEXT)\n"  # no `;` between statements
               "INSERT INTO cities VALUES ('Zurich', 'Switzerland'), ('Graz', 'Austria')\n"
               "CREATE TABLE people (name TEXT, city TEXT REFERENCES cities(name))")
    suite = _suite("SELECT name FROM people WHERE city = 'Graz'", context)
    for db in suite:
        assert {("Zurich", "Switzerland"), ("Graz", "Austria")} <= set(_rows(db, "SELECT * FROM cities"))
        assert len(_rows(db, "SELECT * FROM cities")) > 2  # generated rows follow


def test_foreign_keys_point_at_existing_rows_so_joins_return_rows():
    gold = "SELECT T2.name FROM orders AS T1 JOIN customers AS T2 ON T1.customer_id = T2.id"
    suite = _suite(gold)
    for db in suite:
        dangling = "SELECT 1 FROM orders WHERE customer_id NOT IN (SELECT id FROM customers)"
        assert not _rows(db, dangling)
        assert len(_rows(db, "SELECT DISTINCT id FROM customers")) == len(_rows(db, "SELECT id FROM customers"))
    assert all(run_sql(db, gold).rows for db in suite)


def test_undeclared_join_columns_share_values():
    context = ("CREATE TABLE head (head_id VARCHAR, name VARCHAR); "
               "CREATE TABLE management (department_id VARCHAR, head_id VARCHAR, temporary_acting VARCHAR)")
    gold = ("SELECT DISTINCT T1.name FROM management AS T2 JOIN head AS T1 ON T1.head_id = T2.head_id "
            "WHERE T2.temporary_acting = 'Yes'")
    suite = _suite(gold, context)
    assert suite_match(suite, gold, gold).gold_nonempty > len(suite) / 2
    assert not suite_match(suite, gold.replace("'Yes'", "'No'"), gold).match


def test_double_quoted_strings_of_sql_create_context_style_data_are_literals():
    context = "CREATE TABLE table_name_77 (home_team VARCHAR, away_team VARCHAR, crowd VARCHAR)"
    gold = 'SELECT home_team FROM table_name_77 WHERE away_team = "collingwood"'
    suite = _suite(gold, context)
    assert suite_match(suite, gold, gold).gold_nonempty > len(suite) / 2
    assert not suite_match(suite, gold.replace("collingwood", "carlton"), gold).match


def test_same_seed_same_data_other_seed_other_data():
    def dump(seed):
        return [list(db.iterdump()) for db in _suite(PARIS, seed=seed)]
    assert dump(3) == dump(3)
    assert dump(3) != dump(4)


def test_base_database_comes_first_as_a_copy():
    base = sqlite3.connect(":memory:")
    base.executescript(SHOP + "; INSERT INTO customers VALUES (1, 'Ana', 'Paris', 30)")
    suite = suite_databases(SHOP, PARIS, 3, 0, base)
    assert len(suite) == 4 and suite[0] is not base
    assert _rows(suite[0], "SELECT * FROM customers") == [(1, "Ana", "Paris", 30)]
    suite[0].execute("DELETE FROM customers")
    assert _rows(base, "SELECT COUNT(*) FROM customers") == [(1,)]


@pytest.mark.parametrize(("context", "gold"), [
    (SHOP, "SELECT nickname FROM customers"),
    ("this is not SQL", PARIS),
    ("", "SELECT 1 +"),
])
def test_gold_that_fails_is_reported_not_raised(context, gold):
    result = suite_match(suite_databases(context, gold, 4, 0), gold, gold)
    assert result.match is False and result.databases == 0 and result.gold_errors == 4


def test_context_cannot_write_files_or_run_forever(tmp_path):
    outside, copy = tmp_path / "x.db", tmp_path / "copy.db"
    context = (f"ATTACH DATABASE '{outside}' AS x; CREATE TABLE x.t (a INTEGER); CREATE TABLE t (a INTEGER); "
               f"VACUUM INTO '{copy}'; "
               "INSERT INTO t WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT i FROM n")
    suite = suite_databases(context, "SELECT a FROM t WHERE a > 1e999 OR a = 99999999999999999999", 2, 0)
    assert not outside.exists() and not copy.exists() and len(suite) == 2


@pytest.mark.parametrize(("pred", "gold", "same"), [
    ("select  name\nFROM customers ;", "SELECT name FROM customers", True),
    ("SELECT COUNT( * ) FROM t WHERE a=5", "SELECT COUNT(*) FROM t WHERE a = 5", True),
    ("SELECT name FROM T WHERE city = 'Paris'", "select NAME from t where CITY = 'Paris'", True),
    ("SELECT name FROM t WHERE city = 'paris'", "SELECT name FROM t WHERE city = 'Paris'", False),
    ("SELECT name FROM t WHERE city = 'Lyon'", "SELECT name FROM t WHERE city = 'Paris'", False),
    ("SELECT name FROM t WHERE city = 'a  b'", "SELECT name FROM t WHERE city = 'a b'", False),
    ("SELECT 5 < a FROM t", "SELECT a > 5 FROM t", False),
])
def test_exact_match_ignores_layout_and_keyword_case_but_not_literals(pred, gold, same):
    assert exact_match(pred, gold) is same


def test_repeated_questions_are_scored_once_and_each_sample_says_how_it_was_checked():
    paris = Example("Who lives in Paris?", SHOP, PARIS, "")
    lyon = Example("Who lives in Lyon?", SHOP, PARIS.replace("Paris", "Lyon"), "")
    again = Example("Who lives in Paris?", SHOP, "SELECT 1", "")
    other_schema = Example("Who lives in Paris?", SHOP + ";", PARIS, "")
    assert unique_questions([paris, lyon, again, other_schema, paris]) == [paris, lyon, other_schema]

    test = generate_splits(1234, 50, 20, 5)["test"]
    examples = unique_questions([paris, lyon, *test])
    preds = ["select name from customers where city = 'Paris'", PARIS, *(ex.answer for ex in test)]
    result = score_predictions(examples, preds, 0, generate_databases(1234))
    assert [s["match"] for s in result.samples] == [True, False] + [True] * 5
    assert [s["exact_match"] for s in result.samples] == [True, False] + [True] * 5
    assert [s["databases"] for s in result.samples] == [SUITE_SIZE] * 2 + [SUITE_SIZE + 1] * 5  # + the real one
    assert result.n == 7 and f"{SUITE_SIZE} generated" in result.metric
    assert result.scores == {"sql_execution_accuracy": pytest.approx(6 / 7), "sql_exact_match": pytest.approx(6 / 7)}


def test_every_generated_gold_runs_on_its_whole_suite_and_matches_itself():
    databases = {db_id: db.connect() for db_id, db in generate_databases(1234).items()}
    test = generate_splits(1234, 50, 20, 100)["test"]
    answered = 0
    for ex in test:
        suite = suite_databases(ex.context, ex.answer, SUITE_SIZE, 1234, databases[ex.db_id])
        result = suite_match(suite, ex.answer, ex.answer)
        assert result == result.__class__(True, SUITE_SIZE + 1, 0, result.gold_nonempty), ex.answer
        answered += result.gold_nonempty > len(suite) / 2
    assert answered >= 0.9 * len(test), f"only {answered}/{len(test)} golds return rows on most databases"


def test_dataset_schema_text_cannot_fill_memory_or_stall_the_suite(monkeypatch):
    # a generated column of 4 MB per row made one question's databases take 692 MiB; 20 MB took 10.8 s. With the
    # context's time limit out of the way, only the length limit can refuse those rows: refused means bounded by
    # the guard, not by the schema (no wall-clock bound, which a loaded machine breaks)
    from shardline.tasks.text_to_sql import suite as suite_module

    monkeypatch.setattr(suite_module, "_CONTEXT_TIMEOUT_S", 600.0)
    context = ("CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT, pad TEXT AS (hex(zeroblob(20000000))) STORED);"
               "INSERT INTO t (id, name) VALUES (1, 'a');")
    suite = suite_databases(context, "SELECT name FROM t", 4, seed=0)
    assert all(conn.execute("SELECT COUNT(*) FROM t").fetchone()[0] == 0 for conn in suite)  # rows too big: refused
    big = run_sql(suite[0], "SELECT hex(zeroblob(1000000))")  # a generated query's value is capped as well
    assert big.rows is None and "too big" in big.error
