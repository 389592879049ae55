"""Sandboxed execution of model-generated SQL and execution-match scoring against gold SQL."""

from __future__ import annotations

import re
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass

_READ_ONLY_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
                                sqlite3.SQLITE_RECURSIVE})
_PROGRESS_EVERY = 1_000  # sqlite VM instructions between deadline checks


@dataclass(frozen=True)
class SqlResult:
    """Rows of a successful query, or the error text of a rejected or failed one."""

    rows: list[tuple] | None
    error: str | None


def _authorize(action: int, *_: object) -> int:
    return sqlite3.SQLITE_OK if action in _READ_ONLY_ACTIONS else sqlite3.SQLITE_DENY


def run_sql(conn: sqlite3.Connection, sql: str, max_rows: int = 10_000, timeout_s: float = 2.0) -> SqlResult:
    """Run one read-only SELECT (or WITH ... SELECT); never raises for bad SQL.

    Anything that writes, attaches, changes pragmas or holds several statements is rejected by sqlite's
    authorizer; queries running past ``timeout_s`` or returning more than ``max_rows`` rows are aborted.
    """
    statement = sql.strip().rstrip(";").strip()
    if not re.match(r"(SELECT|WITH)\b", statement, re.IGNORECASE):
        return SqlResult(None, "only a single SELECT statement is allowed")
    deadline = time.monotonic() + timeout_s
    conn.set_authorizer(_authorize)
    conn.set_progress_handler(lambda: time.monotonic() > deadline, _PROGRESS_EVERY)
    try:
        cursor = conn.execute(statement)
        rows = cursor.fetchmany(max_rows + 1)
    except sqlite3.OperationalError as e:
        timed_out = str(e) == "interrupted"
        return SqlResult(None, f"query exceeded the {timeout_s:g}s time limit" if timed_out else str(e))
    except (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError) as e:
        return SqlResult(None, str(e) or type(e).__name__)
    finally:
        conn.set_progress_handler(None, 0)
        conn.set_authorizer(None)
    if len(rows) > max_rows:
        return SqlResult(None, f"query returned more than {max_rows} rows")
    return SqlResult([tuple(row) for row in rows], None)


def _normalise(row: tuple) -> tuple:
    return tuple(round(v, 6) if isinstance(v, float) else v for v in row)


def results_match(pred: SqlResult, gold: SqlResult, ordered: bool) -> bool:
    """Same rows, in order if ``ordered`` else as multisets (floats rounded); errors never match."""
    if pred.rows is None or gold.rows is None:
        return False
    pred_rows = [_normalise(row) for row in pred.rows]
    gold_rows = [_normalise(row) for row in gold.rows]
    return pred_rows == gold_rows if ordered else Counter(pred_rows) == Counter(gold_rows)


def order_matters(gold_sql: str) -> bool:
    """Row order is compared only when the gold SQL has ORDER BY."""
    return re.search(r"\bORDER\s+BY\b", gold_sql, re.IGNORECASE) is not None


def execution_match(conn: sqlite3.Connection, pred_sql: str, gold_sql: str) -> bool:
    """Run both queries on ``conn`` and compare results; order matters only if the gold SQL has ORDER BY."""
    return results_match(run_sql(conn, pred_sql), run_sql(conn, gold_sql), order_matters(gold_sql))
