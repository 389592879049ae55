"""Model-generated SQL and a dataset row's schema text are untrusted (issue 51): each hostile query ends in an error
(or a counted failure) within its time limit, and the process's memory grows by a small, stated amount. The
hostile cases run in a child process whose address space is capped, so the unbounded code fails there (out of
memory) instead of taking the host's memory; the child reports its own peak RSS."""

import json
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from shardline.spec import DataSpec
from shardline.tasks.text_to_sql import generated_splits, reward
from shardline.tasks.text_to_sql import suite as suite_module
from shardline.tasks.text_to_sql.execution import run_sql
from shardline.tasks.text_to_sql.suite import MAX_DATABASE_BYTES, suite_databases
from tests.conftest import LOADED_SLACK_S

CHILD_ADDRESS_SPACE = 3 << 30  # the unbounded code reaches this within seconds (9.9 GiB in issue 51)
REC = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < {n}) "
ISSUE_QUERY = REC.format(n=4000) + "SELECT zeroblob(200000000) FROM c"  # 27.1 s and 9.9 GiB before the fix
HUGE_VALUES = [  # one value far above the length limit, built by each function that can build one
    ISSUE_QUERY,
    "SELECT length(randomblob(300000000))",
    "SELECT length(replace(hex(zeroblob(40000)), '0', hex(zeroblob(40000))))",
    REC.format(n=100000) + "SELECT length(group_concat(hex(zeroblob(40000)))) FROM c",
]
FOUR = "WITH v(x) AS (VALUES ('a'), ('b'), ('c'), ('d')) "
HUGE_PRINTF = [  # printf returns NULL past the length limit; sqlite 3.40's `%c` loops 11-20 s per call first
    FOUR + "SELECT length(printf('%.*c', 2147483647, x)) FROM v",
    FOUR + "SELECT length(format('%.2147483647c', x)) FROM v",
    FOUR + "SELECT length(\"PRINTF\" /* a comment */ ('%s%.*c', x, '2147483647', x)) FROM v",
]
WIDE_RESULT = REC.format(n=9000) + "SELECT " + ", ".join(["hex(zeroblob(45000))"] * 50) + " FROM c"
"""9,000 rows of 50 values of 90 KB each, every value under the length limit: 40 GB of results in total."""


def _in_child(body: str, timeout_s: float = 300) -> dict:
    """Run ``body`` (which fills the dict ``out``) in a fresh interpreter limited to CHILD_ADDRESS_SPACE; return
    ``out`` with ``grew_mib``, the peak RSS above the peak after imports."""
    code = textwrap.dedent(f"""
        import json, resource, sqlite3, time
        resource.setrlimit(resource.RLIMIT_AS, ({CHILD_ADDRESS_SPACE}, {CHILD_ADDRESS_SPACE}))
        from shardline.tasks.text_to_sql.execution import run_sql
        from shardline.tasks.text_to_sql.suite import suite_databases
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = {{}}
    """) + textwrap.dedent(body) + textwrap.dedent("""
        out["grew_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_generated_sql_cannot_build_a_huge_value():
    out = _in_child(f"""
        conn = sqlite3.connect(":memory:")  # a caller's own connection, with sqlite's default limits
        for i, sql in enumerate({HUGE_VALUES + HUGE_PRINTF!r}):
            start = time.monotonic()
            result = run_sql(conn, sql)
            out[i] = [result.rows, result.error, time.monotonic() - start]
    """)
    for i, sql in enumerate(HUGE_VALUES + HUGE_PRINTF):
        rows, error, seconds = out[str(i)]
        if sql in HUGE_VALUES:
            assert error and "too big" in error, sql  # the length limit, not the clock, stopped it
        else:
            assert rows == [[None]] * 4, (sql, error)
        assert seconds < 2.0 + LOADED_SLACK_S, sql
    assert out["grew_mib"] < 64


def test_generated_sql_cannot_return_a_huge_result():
    out = _in_child(f"""
        start = time.monotonic()
        result = run_sql(sqlite3.connect(":memory:"), {WIDE_RESULT!r})
        out["error"], out["seconds"] = result.error, time.monotonic() - start
    """)
    assert out["error"] and "result exceeded" in out["error"]
    assert out["seconds"] < 2.0 + LOADED_SLACK_S
    assert out["grew_mib"] < 128


def test_dataset_schema_cannot_grow_a_suite_database_beyond_its_cap():
    # 5,000 rows of 90 KB fit the 2 s guard (1.8 GB in 0.87 s at 20,000): 450 MB of template, then copied per
    # candidate database and kept while the gold returns no rows
    context = ("CREATE TABLE t (id INTEGER, b BLOB); INSERT INTO t WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL "
               "SELECT x + 1 FROM c WHERE x < 5000) SELECT x, zeroblob(90000) FROM c")
    out = _in_child(f"""
        start = time.monotonic()
        suite = suite_databases({context!r}, "SELECT id FROM t WHERE id < 0", 8, 0)
        out["seconds"] = time.monotonic() - start
        out["databases"] = len(suite)
        out["bytes"] = [db.execute("PRAGMA page_count").fetchone()[0] * db.execute("PRAGMA page_size").fetchone()[0]
                        for db in suite]
    """)
    assert out["databases"] == 8
    assert max(out["bytes"]) <= MAX_DATABASE_BYTES  # the INSERT is refused whole: "database or disk is full"
    assert out["seconds"] < 2.0 + LOADED_SLACK_S
    assert out["grew_mib"] < 64


def test_a_question_holds_at_most_its_suite_and_two_databases_while_building_it(monkeypatch):
    # the gold returns no rows, so every candidate is a fallback: they were all kept alive (3n + 1 databases)
    live: list[sqlite3.Connection] = []
    most = 0

    def counted_copy(conn: sqlite3.Connection, **kwargs) -> sqlite3.Connection:
        nonlocal most
        live[:] = [c for c in live if _is_open(c)]
        live.append(copy(conn, **kwargs))
        most = max(most, len(live) + _is_open(template[0]))
        return live[-1]

    copy, template = suite_module._copy, []
    context_db = suite_module._context_db
    monkeypatch.setattr(suite_module, "_context_db", lambda text: template.append(context_db(text)) or template[0])
    monkeypatch.setattr(suite_module, "_copy", counted_copy)
    suite = suite_databases("CREATE TABLE t (id INTEGER, name TEXT)", "SELECT name FROM t WHERE 0 > 1", 8, 0)
    assert len(suite) == 8
    assert most <= 8 + 2  # the suite, the template and the candidate being filled


def _is_open(conn: sqlite3.Connection) -> bool:
    try:
        conn.total_changes  # noqa: B018 - raises once the connection is closed
    except sqlite3.ProgrammingError:
        return False
    return True


@pytest.mark.parametrize(("sql", "refused"), [
    ("SELECT '" + "x" * 200_000 + "'", "too large"),  # SQLITE_LIMIT_SQL_LENGTH: the query's text
    ("SELECT " + ", ".join(["1"] * 300), "too many columns"),  # SQLITE_LIMIT_COLUMN
    ("SELECT 'a' LIKE '" + "%" * 2000 + "'", "too complex"),  # SQLITE_LIMIT_LIKE_PATTERN_LENGTH
])
def test_run_sql_applies_sqlite_limits_and_gives_the_connection_back_as_it_was(sql, refused):
    conn = sqlite3.connect(":memory:")
    before = {limit: conn.getlimit(limit) for limit in (sqlite3.SQLITE_LIMIT_LENGTH, sqlite3.SQLITE_LIMIT_COLUMN)}
    result = run_sql(conn, sql)
    assert result.rows is None and refused in result.error
    assert {limit: conn.getlimit(limit) for limit in before} == before
    assert len(conn.execute("SELECT zeroblob(300000)").fetchone()[0]) == 300000  # outside run_sql: the caller's


def test_the_sql_reward_builds_one_questions_suite_at_a_time_and_keeps_each_completions_place(monkeypatch):
    built: list[list[sqlite3.Connection]] = []

    def one_at_a_time(*args, **kwargs) -> list[sqlite3.Connection]:
        assert not any(_is_open(conn) for suite in built for conn in suite)  # the batch's suites were all kept
        built.append(suite_databases(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(reward, "suite_databases", one_at_a_time)
    data = DataSpec(train_size=40, validation_size=8, test_size=8)
    a, b = generated_splits(data)["train"][:2]
    found = reward.sql_reward([a, b, a, b], [a.answer, "SELECT 1", "DROP TABLE x", b.answer], data)
    assert found.values == [1.1, 0.1, 0.0, 1.1] and found.solved == [True, False, False, True]
    assert len(built) == 2


@pytest.mark.parametrize("sql", [
    "SELECT printf('%5.2f|%lld|%llx|%!.3c|%,d|%q', 3.14159, 5, 255, 'é', 1234567, 'it''s')",
    "SELECT \"printf\" /* a comment */ ('%.*c|%s', 4294967299, 'x', 'end'), [format]('%.*c%d', '-3', 'y', 7)",
    "SELECT printf(), printf(NULL), printf(5), typeof(printf('%d', 1)), printf('%.*c', 99999, 'x') IS NULL",
    "SELECT CAST('12.5' AS format(9)), typeof(CAST('12.5' AS printf(9))), 'printf(' || printf ( '%s', ')' )",
    "WITH t(format) AS (VALUES ('a')) SELECT format, printf('%.*c', format, 'z') FROM t WHERE format IN ('a')",
])
def test_printf_and_format_in_untrusted_sql_give_sqlites_own_results(sql):
    conn = sqlite3.connect(":memory:")
    assert run_sql(conn, sql).rows == conn.execute(sql).fetchall()


def test_untrusted_sql_cannot_call_the_bounded_printf_with_its_own_limit():
    result = run_sql(sqlite3.connect(":memory:"), "SELECT SHARDLINE_printf(1000000000, '%.*c', 999999999, 'x')")
    assert result.rows is None and "not a function that SQL may call" in result.error


_TERMS = " + ".join("max(" + ", ".join(["length(hex(randomblob(40000)))"] * 100) + ")" for _ in range(10))
SLOW_CHECK = f"CREATE TABLE t (id INTEGER, name TEXT CHECK ({_TERMS} > 0))"
"""1,000 values of 80 KB for every row inserted: 0.3 s a row here, a fill of 3-12 rows past a 0.05 s limit."""


@pytest.mark.parametrize(("context", "gold"), [
    (SLOW_CHECK, "SELECT name FROM t"),
    ("CREATE TABLE t (id INTEGER, name TEXT)", REC.format(n=10**12) + "SELECT count(*) FROM c"),
])
def test_a_schema_or_gold_that_runs_out_of_time_costs_one_candidate_not_every_one(monkeypatch, context, gold):
    # each candidate paid the whole time limit: 3n of them (48 s) for a slow schema, n for a slow gold
    fills = []
    fill = suite_module._fill
    monkeypatch.setattr(suite_module, "_CONTEXT_TIMEOUT_S", 0.05)
    monkeypatch.setattr(suite_module, "run_sql", lambda conn, sql: run_sql(conn, sql, timeout_s=0.05))
    monkeypatch.setattr(suite_module, "_fill", lambda *args: fills.append(1) or fill(*args))
    suite = suite_databases(context, gold, 8, 0)
    assert len(fills) == 1 and len(suite) == 1


def test_a_schema_cannot_stall_the_suite_in_printf():
    # sqlite's `%c` loop on every generated row: 11-20 s each, 3-12 rows, up to 24 candidates; out of the guard's
    # reach (one VM instruction)
    context = "CREATE TABLE t (id INTEGER, name TEXT CHECK (printf('%.*c', 2147483647, name) IS NULL))"
    out = _in_child(f"""
        start = time.monotonic()
        suite = suite_databases({context!r}, "SELECT name FROM t", 8, 0)
        out["seconds"] = time.monotonic() - start
        out["rows"] = [db.execute("SELECT COUNT(*) FROM t").fetchone()[0] for db in suite]
    """, timeout_s=60)
    assert out["seconds"] < 2.0 + LOADED_SLACK_S
    assert len(out["rows"]) == 8 and all(out["rows"])  # the CHECK passed (NULL IS NULL), as in sqlite


def test_a_table_wider_than_the_column_limit_can_still_be_queried_by_name():
    wide = sqlite3.connect(":memory:")
    wide.execute(f"CREATE TABLE wide ({', '.join(f'c{i} INTEGER' for i in range(300))})")
    wide.execute("INSERT INTO wide (c1, c299) VALUES (1, 2)")
    wide.commit()
    fresh = sqlite3.connect(":memory:")
    wide.backup(fresh)  # its schema is read at its first statement: run_sql's
    assert run_sql(fresh, "SELECT c1, c299 FROM wide").rows == [(1, 2)]
    assert "too many columns" in run_sql(fresh, "SELECT * FROM wide").error
