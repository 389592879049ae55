"""Sandboxed execution of model-generated SQL and execution-match scoring against gold SQL."""

from __future__ import annotations

import contextlib
import functools
import math
import re
import sqlite3
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

_READ_ONLY_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
                                sqlite3.SQLITE_RECURSIVE})
_PROGRESS_EVERY = 1_000  # sqlite VM instructions between deadline checks
MAX_VALUE_BYTES = 100_000
"""SQLITE_LIMIT_LENGTH while untrusted SQL runs: no string, blob or row above it. The deadline is checked only
between VM instructions and one instruction builds a whole value, so without it `zeroblob(200000000)` per row ran
27.1 s past a 2 s limit to a 9.9 GiB peak; zeroblob, randomblob, replace, group_concat and the rest now fail at
once with "string or blob too big", and printf/format return NULL as sqlite does past the limit (`_bounded_printf`
keeps its `%c` from looping on for seconds first)."""
MAX_RESULT_BYTES = 16 << 20
"""The most a result may hold as Python objects (``sys.getsizeof`` of rows and values), whatever its row count."""
_TIMED_OUT = re.compile(r"query exceeded the \S+s time limit")
_LIMITS = {  # sqlite's own limits, lowered (never raised) while untrusted SQL runs
    sqlite3.SQLITE_LIMIT_LENGTH: MAX_VALUE_BYTES,
    sqlite3.SQLITE_LIMIT_SQL_LENGTH: 100_000,  # the query's text, in bytes
    sqlite3.SQLITE_LIMIT_COLUMN: 200,  # result columns: one row holds at most 200 * MAX_VALUE_BYTES (20 MB)
    sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH: 1_000,
}


@dataclass(frozen=True)
class SqlResult:
    """Rows of a successful query, or the error text of a rejected or failed one."""

    rows: list[tuple] | None
    error: str | None

    @property
    def timed_out(self) -> bool:
        """The query ran into its time limit."""
        return self.error is not None and _TIMED_OUT.fullmatch(self.error) is not None


def _authorize(action: int, *_: object) -> int:
    return sqlite3.SQLITE_OK if action in _READ_ONLY_ACTIONS else sqlite3.SQLITE_DENY


def run_sql(conn: sqlite3.Connection, sql: str, max_rows: int = 10_000, timeout_s: float = 2.0,
            max_result_bytes: int = MAX_RESULT_BYTES) -> SqlResult:
    """Run one read-only SELECT (or WITH ... SELECT); never raises for bad SQL.

    Anything that writes, attaches, changes pragmas or holds several statements is rejected by sqlite's
    authorizer; queries running past ``timeout_s``, returning more than ``max_rows`` rows or holding more than
    ``max_result_bytes``, or building a value above :data:`MAX_VALUE_BYTES`, are aborted. sqlite's limits
    (:data:`_LIMITS`) apply while the query runs; the connection gets its own back afterwards.
    """
    statement = sql.strip().rstrip(";").strip()
    if not re.match(r"(SELECT|WITH)\b", statement, re.IGNORECASE):
        return SqlResult(None, "only a single SELECT statement is allowed")
    deadline = time.monotonic() + timeout_s
    with contextlib.suppress(sqlite3.Error):  # read the schema under the caller's limits: its tables may be wider
        conn.execute("SELECT 1 FROM sqlite_master LIMIT 0").fetchall()
    previous = {limit: conn.setlimit(limit, min(value, conn.getlimit(limit))) for limit, value in _LIMITS.items()}
    conn.set_authorizer(_authorize)
    conn.set_progress_handler(lambda: time.monotonic() > deadline, _PROGRESS_EVERY)
    try:
        statement = _guard_printf(conn, statement)
        cursor = conn.execute(statement)
        try:
            return _fetch(cursor, max_rows, max_result_bytes)
        finally:
            cursor.close()  # ends the statement: its sorter and temporary tables go now
    except sqlite3.OperationalError as e:
        timed_out = str(e) == "interrupted"
        return SqlResult(None, f"query exceeded the {timeout_s:g}s time limit" if timed_out else str(e))
    except (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError) as e:
        return SqlResult(None, str(e) or type(e).__name__)
    finally:
        conn.set_progress_handler(None, 0)
        conn.set_authorizer(None)
        for limit, value in previous.items():
            conn.setlimit(limit, value)


def _guard_printf(conn: sqlite3.Connection, statement: str) -> str:
    """``statement`` with printf/format bounded by ``conn``'s length limit; a statement longer than sqlite accepts
    is left for sqlite to refuse, unread."""
    if len(statement) > conn.getlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH) or not re.search("printf|format", statement,
                                                                                         re.IGNORECASE):
        return statement
    guarded = _printf_rewritten(statement, conn.getlimit(sqlite3.SQLITE_LIMIT_LENGTH))
    if guarded != statement:
        _install_printf(conn)
    return guarded


def _fetch(cursor: sqlite3.Cursor, max_rows: int, max_result_bytes: int) -> SqlResult:
    """The rows one at a time, so that a result over either bound stops after one row (at most 20 MB) too many."""
    rows: list[tuple] = []
    held = 0
    for row in cursor:
        values = tuple(row)
        held += sys.getsizeof(values) + sum(sys.getsizeof(v) for v in values)
        if len(rows) == max_rows:
            return SqlResult(None, f"query returned more than {max_rows} rows")
        if held > max_result_bytes:
            return SqlResult(None, f"query result exceeded {max_result_bytes:,} bytes")
        rows.append(values)
    return SqlResult(rows, None)


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


# ---------------------------------------------------------------- printf and format, bounded
# Before sqlite 3.42 a `%c` with a precision appends its character once per repeat, and goes on appending after the
# result has passed SQLITE_LIMIT_LENGTH: `printf('%.*c', 2147483647, 'x')` is one VM instruction of 11-20 s (sqlite
# 3.40.1, measured), out of the progress handler's reach, and a query may make it once per row. run_sql sends such
# calls to `_bounded_printf`, which reads the format as sqlite's printf.c does, returns NULL at once when the `%c`
# repeats add up to more than the length limit (sqlite's own answer, once it has looped) and otherwise returns what
# sqlite's printf returns.

_PRINTF = "shardline_printf"
"""What untrusted SQL calls instead of printf/format, with the length limit as an extra first argument; a query
that names it itself is refused, so the limit is always the caller's."""
_NAMES = {"printf", "format"} if sqlite3.sqlite_version_info >= (3, 38) else {"printf"}  # format() came in 3.38
_SQL_TOKEN = re.compile(r"""(?P<skip>\s+|--[^\n]*|/\*[\s\S]*?(?:\*/|$)|'(?:[^']|'')*'?)
    |(?P<name>"(?:[^"]|"")*"?|`(?:[^`]|``)*`?|\[[^\]]*\]?|[^\W\d][\w$]*)|(?P<other>[\d.]\w*|.)""", re.X)
_SPEC = re.compile(r"[-+ #!0,]*([1-9][0-9]*|\*)?(?:\.(\*|[0-9]*))?(?:ll?)?(.)?", re.S)  # printf.c's flag loop
_CONVERSIONS = frozenset("dsgzqQwcouxXfeEGinpr%")  # any other letter ends the format (T and S are internal only)
_NO_ARGUMENT = frozenset("n%")
_INT64 = (-(1 << 63), (1 << 63) - 1)
_delegates = threading.local()  # a connection per thread that runs sqlite's own printf


def _printf_rewritten(sql: str, max_length: int) -> str:
    """``sql`` with each call of printf or format (names quoted or not, comments before the "(") made a call of
    :data:`_PRINTF` with ``max_length`` first; ValueError if ``sql`` names :data:`_PRINTF` itself."""
    tokens = [(m.lastgroup, m.group()) for m in _SQL_TOKEN.finditer(sql)]
    out = []
    before = ""  # the last token that is not whitespace or a comment
    for i, (kind, text) in enumerate(tokens):
        name = (text[1:-1] if text[:1] in "\"`[" else text).lower() if kind == "name" else ""
        if name == _PRINTF:
            raise ValueError(f"{_PRINTF} is not a function that SQL may call")
        before, previous = (text.lower(), before) if kind != "skip" else (before, before)
        significant = _next_two(tokens, i) if name in _NAMES and previous != "as" else []  # AS format(9): a type
        if significant and tokens[significant[0]][1] == "(":
            empty = len(significant) > 1 and tokens[significant[1]][1] == ")"
            out.append(f"{_PRINTF}({max_length}{'' if empty else ','}")
            tokens[significant[0]] = ("skip", "")  # the "(" is written above
            continue
        out.append(text)
    return "".join(out)


def _next_two(tokens: list[tuple[str | None, str]], i: int) -> list[int]:
    """Where the two tokens after ``tokens[i]`` that are not whitespace or comments are (fewer at the end)."""
    found = []
    for j in range(i + 1, len(tokens)):
        if tokens[j][0] != "skip":
            found.append(j)
            if len(found) == 2:
                break
    return found


def install_bounded_printf(conn: sqlite3.Connection, max_length: int) -> None:
    """Make printf and format on ``conn``, a connection whose SQLITE_LIMIT_LENGTH stays ``max_length``, the bounded
    ones (for the dataset text that runs on it: CHECK and generated-column expressions, INSERT ... SELECT)."""
    for name in _NAMES:
        conn.create_function(name, -1, functools.partial(_bounded_printf, max_length), deterministic=True)


def _install_printf(conn: sqlite3.Connection) -> None:
    """Make :data:`_PRINTF` callable on ``conn`` (kept for the connection's life: it holds no state)."""
    with contextlib.suppress(sqlite3.OperationalError):  # already there, and a statement of the caller's is open
        conn.create_function(_PRINTF, -1, _bounded_printf, deterministic=True)


def _bounded_printf(max_length: int, fmt: object = None, *args: object) -> str | None:
    """sqlite's ``printf(fmt, *args)`` on a connection whose SQLITE_LIMIT_LENGTH is ``max_length``."""
    if fmt is None:
        return None
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else str(fmt)
    if _repeats(text.partition("\0")[0], args) > max_length:
        return None
    delegate = getattr(_delegates, "conn", None)
    if delegate is None:
        delegate = _delegates.conn = sqlite3.connect(":memory:")
    delegate.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, max_length)
    marks = ", ".join("?" * (1 + len(args)))
    return delegate.execute(f"SELECT printf({marks})", (fmt, *args)).fetchone()[0]


def _repeats(fmt: str, args: Sequence[object]) -> int:
    """How many characters the format's `%c` conversions repeat in all: a lower bound of the result's length."""
    used = total = 0
    pos = fmt.find("%")
    while pos >= 0:
        m = _SPEC.match(fmt, pos + 1)
        assert m is not None  # every part of the pattern is optional
        width, precision, conversion = m.groups()
        if conversion not in _CONVERSIONS:
            break  # sqlite stops formatting here (this includes a "%" at the very end)
        if width == "*":
            used += used < len(args)
        if precision == "*":
            repeat = _c_int(_int64(args[used]) if used < len(args) else 0)
            used += used < len(args)
            repeat = -repeat if -0x7FFFFFFF <= repeat < 0 else repeat  # a negative precision counts as positive
        else:  # digits: an unsigned 32-bit sum, whose value only the last 32 digits decide (2**32 divides 10**32)
            repeat = int(precision[-32:] or 0) % (1 << 32) & 0x7FFFFFFF if precision is not None else -1
        used += conversion not in _NO_ARGUMENT and used < len(args)
        total += repeat if conversion == "c" and repeat > 1 else 0
        pos = fmt.find("%", m.end())
    return total


def _int64(value: object) -> int:
    """sqlite3_value_int64 of an argument; for text, the larger of its integer prefix and its value as a number, so
    that no reading of it by any sqlite version is missed."""
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return 0 if math.isnan(value) else int(max(min(value, _INT64[1]), _INT64[0]))
    if not isinstance(value, str | bytes):
        return 0
    raw = value if isinstance(value, bytes) else value.encode()
    prefix = re.match(rb"\s*([+-]?)0*(\d{1,19})(\d?)", raw)  # past 19 digits sqlite saturates
    number = re.match(rb"\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)", raw)
    if prefix is None:
        whole = 0
    elif prefix[3]:
        whole = _INT64[0] if prefix[1] == b"-" else _INT64[1]
    else:
        whole = int(prefix[1] + prefix[2])
    readings = [whole, _int64(float(number[1])) if number else 0]
    return max((max(min(v, _INT64[1]), _INT64[0]) for v in readings), key=lambda v: abs(_c_int(v)))


def _c_int(value: int) -> int:
    """C's ``(int)`` of an int64: the low 32 bits, signed."""
    low = value & 0xFFFFFFFF
    return low - (1 << 32) if low >= 1 << 31 else low
