import sqlite3
import time

import pytest

from shardline.tasks.text_to_sql.execution import SqlResult, execution_match, results_match, run_sql
from tests.conftest import LOADED_SLACK_S


@pytest.fixture
def conn() -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (x INTEGER, name TEXT, score REAL)")
    conn.executemany("INSERT INTO t VALUES (?, ?, ?)", [(1, "a", 1.5), (2, "b", 2.0), (3, "c", 2.0)])
    return conn


def _count_rows(conn: sqlite3.Connection) -> int:
    return conn.execute("SELECT COUNT(*) FROM t").fetchone()[0]


def test_run_sql_returns_rows_as_tuples(conn):
    result = run_sql(conn, "SELECT x, name FROM t WHERE x > 1 ORDER BY x")
    assert result == SqlResult([(2, "b"), (3, "c")], None)


def test_trailing_semicolon_and_with_clause_are_allowed(conn):
    assert run_sql(conn, "SELECT COUNT(*) FROM t;").rows == [(3,)]
    assert run_sql(conn, "WITH big AS (SELECT x FROM t WHERE x > 1) SELECT SUM(x) FROM big").rows == [(5,)]


def test_bad_sql_returns_error_instead_of_raising(conn):
    for sql in ("SELECT nope FROM t", "SELEC x FROM t", "SELECT x FROM missing", "", "SELECT x FROM t WHERE"):
        result = run_sql(conn, sql)
        assert result.rows is None and result.error


@pytest.mark.parametrize("sql", [
    "DROP TABLE t",
    "INSERT INTO t VALUES (4, 'd', 1.0)",
    "UPDATE t SET x = 0",
    "DELETE FROM t",
    "CREATE TABLE u (a INTEGER)",
    "ATTACH DATABASE ':memory:' AS other",
    "PRAGMA table_info(t)",
    "WITH c AS (SELECT 1) DELETE FROM t",
    "SELECT 1; DROP TABLE t",
    "SELECT x FROM t; SELECT name FROM t",
])
def test_run_sql_rejects_writes_and_anything_but_one_select(conn, sql):
    result = run_sql(conn, sql)
    assert result.rows is None and result.error
    assert _count_rows(conn) == 3


def test_runaway_query_is_aborted(conn):
    forever = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT COUNT(*) FROM n"
    start, timeout_s = time.monotonic(), 0.2
    result = run_sql(conn, forever, timeout_s=timeout_s)
    assert timeout_s <= time.monotonic() - start < timeout_s + LOADED_SLACK_S  # the query alone never ends
    assert result.rows is None and "time limit" in result.error


def test_connection_is_usable_after_an_aborted_or_rejected_query(conn):
    run_sql(conn, "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT MAX(i) FROM n",
            timeout_s=0.05)
    run_sql(conn, "DROP TABLE t")
    assert run_sql(conn, "SELECT COUNT(*) FROM t").rows == [(3,)]
    conn.execute("INSERT INTO t VALUES (4, 'd', 0.5)")  # the sandbox is lifted once run_sql returns
    assert _count_rows(conn) == 4


def test_result_larger_than_max_rows_is_an_error(conn):
    assert run_sql(conn, "SELECT x FROM t", max_rows=3).rows == [(1,), (2,), (3,)]
    assert "more than 2 rows" in run_sql(conn, "SELECT x FROM t", max_rows=2).error


def test_unordered_results_match_as_multisets():
    gold = SqlResult([(1,), (2,), (2,)], None)
    assert results_match(SqlResult([(2,), (1,), (2,)], None), gold, ordered=False)
    assert not results_match(SqlResult([(1,), (2,)], None), gold, ordered=False)
    assert not results_match(SqlResult([(1,), (1,), (2,)], None), gold, ordered=False)


def test_ordered_results_must_match_in_order():
    gold = SqlResult([(1,), (2,)], None)
    assert results_match(SqlResult([(1,), (2,)], None), gold, ordered=True)
    assert not results_match(SqlResult([(2,), (1,)], None), gold, ordered=True)


def test_floats_are_normalised_before_comparing():
    assert results_match(SqlResult([(2.0, "a")], None), SqlResult([(2, "a")], None), ordered=False)
    assert results_match(SqlResult([(0.1 + 0.2,)], None), SqlResult([(0.3,)], None), ordered=True)
    assert not results_match(SqlResult([(2.5,)], None), SqlResult([(2,)], None), ordered=True)


def test_errors_never_match():
    error = SqlResult(None, "no such table")
    assert not results_match(error, error, ordered=False)
    assert not results_match(error, SqlResult([], None), ordered=False)
    assert not results_match(SqlResult([], None), error, ordered=False)


def test_execution_match_cares_about_order_only_when_gold_has_order_by(conn):
    assert execution_match(conn, "SELECT x FROM t ORDER BY x DESC", "SELECT x FROM t")
    assert not execution_match(conn, "SELECT x FROM t", "SELECT x FROM t order  by x DESC")
    assert execution_match(conn, "SELECT x FROM t ORDER BY x DESC", "SELECT x FROM t order by x desc")


def test_execution_match_accepts_equivalent_sql_and_rejects_wrong_sql(conn):
    assert execution_match(conn, "select count(name) from t where score = 2",
                           "SELECT COUNT(*) FROM t WHERE score >= 2")
    assert execution_match(conn, "SELECT AVG(score) * 1.0 FROM t", "SELECT SUM(score) / 3 FROM t")
    assert not execution_match(conn, "SELECT name FROM t", "SELECT x FROM t")
    assert not execution_match(conn, "DELETE FROM t", "SELECT x FROM t WHERE 0")
