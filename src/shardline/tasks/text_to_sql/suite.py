"""Test-suite execution scoring (Zhong et al., EMNLP 2020): a prediction is right only if its result equals the
gold query's on every database of a suite built for its question. One database, let alone empty tables, cannot
tell `city = 'Paris'` from `city = 'Lyon'`; the suite's rows come from small per-column pools seeded with the
gold's literals and their neighbours, so that filters, joins and groups hit."""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import math
import random
import re
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from shardline.tasks.text_to_sql.execution import (
    MAX_VALUE_BYTES,
    install_bounded_printf,
    order_matters,
    results_match,
    run_sql,
)

_TOKEN = re.compile(r"""(?P<ws>\s+|--[^\n]*|/\*[\s\S]*?\*/)|(?P<str>'(?:[^']|'')*')
    |(?P<qid>"(?:[^"]|"")*"|`[^`]*`|\[[^\]]*\])|(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
    |(?P<word>[A-Za-z_][\w$]*(?:\.[A-Za-z_][\w$]*)?)|(?P<op><=|>=|<>|!=|==|\|\||\S)""", re.X)
_WORDS = ("Amber", "Birch", "Cedar", "Delta", "Ember", "Falcon", "Garnet", "Harbor", "Indigo", "Juniper",
          "Kestrel", "Lotus", "Maple", "Nimbus", "Onyx", "Pebble", "Quartz", "Raven", "Sage", "Tundra")
_COMPARE = {"=", "==", "!=", "<>", "<", ">", "<=", ">="}
_LITERAL_TO_COLUMN = _COMPARE | {"(", ",", "-", "NOT", "LIKE", "GLOB", "IN", "IS", "BETWEEN"}
_AFTER_TABLE = {"WHERE", "JOIN", "INNER", "LEFT", "RIGHT", "FULL", "OUTER", "CROSS", "NATURAL", "ON", "USING",
                "GROUP", "ORDER", "LIMIT", "HAVING", "UNION", "INTERSECT", "EXCEPT", "WINDOW"}
_RANGE = {"<", ">", "<=", ">=", "between"}
_AFTER_GROUP_BY = {"having", "order", "limit", "union", "intersect", "except", ")"}
_CONTEXT_DENIED = {sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH, sqlite3.SQLITE_PRAGMA}  # no files, no settings
_CONTEXT_TIMEOUT_S = 2.0
MAX_DATABASE_BYTES = 4 << 20
"""The most a generated suite database (and its temp schema) may hold: `PRAGMA max_page_count`, set before any
dataset text runs. Past it sqlite answers "database or disk is full" and the statement is skipped, so a short
`context` that INSERTs blobs (1.8 GB in 0.87 s, measured) leaves at most this in each database, and a question's
suite holds at most ``n + 2`` of them while it is built."""
_EXACT_SHARE = 0.25  # share of a hinted column's values that are the gold's own literals
_TRIES = 3  # candidate databases per database kept

Key = tuple[str, str]  # (table, column), lower case: sqlite names are case-insensitive


@dataclass(frozen=True)
class SuiteResult:
    """How a prediction fared on a suite: ``match`` only if it agreed with the gold on every database."""

    match: bool
    databases: int  # databases the gold ran on
    gold_errors: int  # databases where the gold failed
    gold_nonempty: int  # databases where the gold returned at least one row


@dataclass(frozen=True)
class _Column:
    name: str
    kind: str  # integer, real, text or date
    nullable: bool
    key: bool  # primary key, unique, or named id: values must not repeat


@dataclass
class _Table:
    name: str
    columns: list[_Column]
    refs: dict[str, Key] = field(default_factory=dict)  # column -> referenced (table, column)


@dataclass
class _Hints:
    """What the gold query says about the data: literals per column, loose literals per kind, join links."""

    exact: dict[Key, list] = field(default_factory=dict)
    near: dict[Key, list] = field(default_factory=dict)
    loose: dict[str, list] = field(default_factory=dict)
    links: list[tuple[Key, Key]] = field(default_factory=list)
    grouped: set[Key] = field(default_factory=set)  # GROUP BY columns: few values, so groups hold several rows


def _tokens(sql: str) -> list[tuple[str, str]]:
    return [(m.lastgroup or "", m.group()) for m in _TOKEN.finditer(sql) if m.lastgroup != "ws"]


def normalised_tokens(sql: str) -> list[str]:
    """The query's tokens without whitespace, comments and final ``;``, lower case outside quoted literals and
    names."""
    tokens = [text if kind in ("str", "qid") else text.lower() for kind, text in _tokens(sql)]
    while tokens and tokens[-1] == ";":
        tokens.pop()
    return tokens


def exact_match(pred: str, gold: str) -> bool:
    """The same tokens up to whitespace, comments, case outside quoted literals and names, and final ``;``."""
    return normalised_tokens(pred) == normalised_tokens(gold)


def suite_match(databases: list[sqlite3.Connection], pred_sql: str, gold_sql: str) -> SuiteResult:
    """Compare ``pred_sql`` with ``gold_sql`` on every database where the gold runs (never raises); order matters
    only if the gold has ORDER BY (:func:`execution_match`). A gold that fails everywhere gives ``databases == 0``."""
    ran = errors = nonempty = 0
    match, ordered = True, order_matters(gold_sql)
    for conn in databases:
        gold = run_sql(conn, gold_sql)  # once per database: its result is the one compared
        if gold.rows is None:
            errors += 1
            continue
        ran, nonempty = ran + 1, nonempty + bool(gold.rows)
        match = match and results_match(run_sql(conn, pred_sql), gold, ordered)
    return SuiteResult(match and ran > 0, ran, errors, nonempty)


def suite_databases(context: str, gold_sql: str, n: int, seed: int,
                    base: sqlite3.Connection | None = None) -> list[sqlite3.Connection]:
    """``n`` in-memory databases: the schema and INSERTed rows of ``context`` (failing statements skipped) plus
    generated rows, preferring those of ``3 * n`` candidates where the gold returns rows; a copy of ``base`` (never
    ``base`` itself) first when given. Deterministic in (``seed``, ``context``, ``gold_sql``) unless the context or
    the gold runs into its time limit, which ends the search (fewer databases). Each generated database holds at most
    :data:`MAX_DATABASE_BYTES`, and no more than ``n`` of them, the template and the candidate being filled are alive
    at once."""
    template = _context_db(context)
    tables = _read_schema(template)
    hints = _gold_hints(gold_sql, tables)
    roots = _link(tables, hints)
    digest = hashlib.sha256(f"{seed}\0{context}\0{gold_sql}".encode()).digest()  # stable, unlike hash()
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    answered: list[sqlite3.Connection] = []
    others: list[sqlite3.Connection] = []  # the first candidates without rows that may still be needed, in order
    tried = errors = 0
    while len(answered) < n and tried < _TRIES * n and errors < n:
        conn = _copy(template)
        with _guarded(conn) as stopped, contextlib.suppress(sqlite3.Error):  # schema expressions run on each insert
            _fill(conn, tables, hints, roots, rng)
        gold = run_sql(conn, gold_sql)
        tried, errors = tried + 1, errors + (gold.rows is None)  # a gold that fails on n databases will not answer
        (answered if gold.rows else others).append(conn)
        while len(answered) + len(others) > n:  # closed at once, not kept to the end: copies do not pile up
            others.pop().close()
        if stopped or gold.timed_out:  # it would on every candidate: 3n time limits (48 s) for one question
            break
    template.close()
    return ([_copy(base, capped=False)] if base is not None else []) + answered + others


def _connect(capped: bool = True) -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:")
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
    install_bounded_printf(conn, MAX_VALUE_BYTES)  # a CHECK with printf('%.*c', 2147483647, x) took 11-20 s a row
    if capped:  # the pages of an in-memory database are memory
        pages = MAX_DATABASE_BYTES // conn.execute("PRAGMA page_size").fetchone()[0]
        conn.execute(f"PRAGMA main.max_page_count = {pages}")
        conn.execute(f"PRAGMA temp.max_page_count = {pages}")
    return conn


@contextlib.contextmanager
def _guarded(conn: sqlite3.Connection) -> Iterator[list[bool]]:
    """Run dataset text (schema, generated columns, CHECK expressions) with no ATTACH (files), no PRAGMA and a
    time limit; what it yields is true once the time limit has stopped a statement."""
    deadline = time.monotonic() + _CONTEXT_TIMEOUT_S
    stopped: list[bool] = []

    def past_deadline() -> bool:
        if time.monotonic() > deadline:
            stopped[:] = [True]
            return True
        return False

    conn.set_authorizer(lambda action, *_: sqlite3.SQLITE_DENY if action in _CONTEXT_DENIED else sqlite3.SQLITE_OK)
    conn.set_progress_handler(past_deadline, 1_000)
    try:
        yield stopped
    finally:
        conn.set_progress_handler(None, 0)
        conn.set_authorizer(None)


def _copy(conn: sqlite3.Connection, capped: bool = True) -> sqlite3.Connection:
    """A new in-memory database with ``conn``'s main schema and rows; ``capped`` at MAX_DATABASE_BYTES unless it is
    the caller's own ``base``."""
    out = _connect(capped)
    conn.backup(out)
    return out


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _statements(script: str) -> list[str]:
    """Split at top-level ``;`` and before a top-level CREATE/INSERT (contexts often omit the ``;``)."""
    out, start, depth, content = [], 0, 0, False
    for m in _TOKEN.finditer(script):
        text = m.group()
        if m.lastgroup == "ws":
            continue
        if depth == 0 and (text == ";" or (content and text.upper() in ("CREATE", "INSERT"))):
            out.append(script[start:m.start()])
            start, content = (m.end(), False) if text == ";" else (m.start(), True)
            continue
        depth = max(0, depth + (text == "(") - (text == ")"))
        content = True
    return [s for s in [*out, script[start:]] if s.strip()]


def _context_db(context: str) -> sqlite3.Connection:
    """The context's tables and rows; it is user data, so it runs `_guarded`, within `MAX_VALUE_BYTES` per value and
    `MAX_DATABASE_BYTES` in all."""
    conn = _connect()
    with _guarded(conn):
        for statement in _statements(context):
            with contextlib.suppress(sqlite3.Error, sqlite3.Warning, ValueError, OverflowError):
                conn.execute(statement)
        conn.commit()
    return conn


def _kind(declared: str, name: str) -> str:
    """sqlite's type affinity rules, with dates (stored as ISO text) told apart by type or column name."""
    t, dated = declared.upper(), re.search(r"(^|_)(date|time|day)$|_(at|on)$", name.lower())
    if "INT" in t:
        return "integer"
    if "DATE" in t or "TIME" in t or (dated and not re.search("REAL|FLOA|DOUB", t)):
        return "date"
    if any(s in t for s in ("CHAR", "CLOB", "TEXT", "BLOB")) or not t:
        return "text"
    return "real"


def _read_schema(conn: sqlite3.Connection) -> dict[str, _Table]:
    names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                        "AND name NOT LIKE 'sqlite_%' ORDER BY rowid")]
    tables: dict[str, _Table] = {}
    for name in names:
        info = conn.execute(f"PRAGMA table_info({_q(name)})").fetchall()  # cid, name, type, notnull, default, pk
        pk = {r[1].lower() for r in info if r[5]}
        unique = set(pk) if len(pk) == 1 else set()
        for index in conn.execute(f"PRAGMA index_list({_q(name)})").fetchall():  # seq, name, unique, ...
            cols = [r[2].lower() for r in conn.execute(f"PRAGMA index_info({_q(index[1])})")]
            unique |= set(cols) if index[2] and len(cols) == 1 else set()
        if not pk and not unique and "id" in {r[1].lower() for r in info}:
            unique = {"id"}  # an undeclared `id` is a key by convention (the generated dataset's schemas)
        columns = [_Column(r[1], _kind(r[2] or "", r[1]), not r[3] and not r[5], r[1].lower() in unique)
                   for r in info]
        tables[name.lower()] = _Table(name, columns)
    for table in tables.values():
        for fk in conn.execute(f"PRAGMA foreign_key_list({_q(table.name)})").fetchall():  # id, seq, table, from, to
            parent = tables.get(fk[2].lower())
            to = fk[4] or next((c.name for c in parent.columns if c.key), None) if parent else None
            if parent and to and any(c.name.lower() == to.lower() for c in parent.columns):
                table.refs[fk[3].lower()] = (fk[2].lower(), to.lower())
    return tables


# ---------------------------------------------------------------- what the gold query says about the data

def _literal_values(kind: str, text: str, negative: bool, like: bool) -> tuple[list, list]:
    """The literal's own value(s) and neighbours that sit just across the gold's comparison."""
    if kind == "num":
        value = (int(text) if text.isdigit() else float(text)) * (-1 if negative else 1)
        if not math.isfinite(value):
            return [], []
        step = 1 if isinstance(value, int) else 10 ** -max(1, len(text.partition(".")[2]))
        return [value], [round(value - step, 6), round(value + step, 6)]
    s = text[1:-1].replace(text[0] * 2, text[0])
    if like and ("%" in s or "_" in s):  # a value the pattern matches, one it matches with more around it
        return [s.replace("%", "").replace("_", "x")], [s.replace("%", "zz").replace("_", "y")]
    with contextlib.suppress(ValueError):
        day = dt.date.fromisoformat(s)
        return [s], [(day + dt.timedelta(days=d)).isoformat() for d in (-1, 1)]
    return [s], [v for v in dict.fromkeys((s.lower(), s.upper(), s + " ")) if v != s]  # = versus LIKE, trim


def _gold_hints(gold_sql: str, tables: dict[str, _Table]) -> _Hints:
    names: dict[str, set[str]] = {}  # column name -> tables that have it
    for t, table in tables.items():
        for col in table.columns:
            names.setdefault(col.name.lower(), set()).add(t)
    aliases: dict[str, str] = {}  # alias or table name -> table
    for m in re.finditer(r"(?:\bFROM|\bJOIN|,)\s*(\w+)(?:\s+(?:AS\s+)?(\w+))?", gold_sql, re.IGNORECASE):
        alias = m[2] if m[2] and m[2].upper() not in _AFTER_TABLE else m[1]
        if m[1].lower() in tables:
            aliases[m[1].lower()] = aliases[alias.lower()] = m[1].lower()
    tokens: list[tuple[str, str, str]] = []  # kind, text, lower-case name
    refs: dict[int, set[Key]] = {}  # token -> columns it may name
    for i, (kind, text) in enumerate(_tokens(gold_sql)):
        name = text[1:-1].lower() if kind == "qid" else text.lower()
        qualifier, _, column = name.rpartition(".")
        owners = {aliases.get(qualifier, qualifier)} if qualifier else set(aliases.values()) or set(tables)
        if kind in ("word", "qid") and names.get(column, set()) & owners:
            refs[i] = {(t, column) for t in names[column] & owners}
        elif kind == "qid" and text[0] == '"' and name not in aliases:
            kind = "str"  # sqlite reads "x" as the string 'x' when no column is called x
        tokens.append((kind, text, name))
    hints = _Hints()
    for i, (kind, text, _) in enumerate(tokens):
        if kind not in ("num", "str") or (i and tokens[i - 1][2] in ("limit", "offset")):
            continue
        negative = i > 1 and tokens[i - 1][1] == "-" and tokens[i - 2][0] not in ("num", "word", "qid")
        exact, near = _literal_values(kind, text, negative, i > 0 and tokens[i - 1][2] in ("like", "glob"))
        before, after = (tokens[j][2] if 0 <= j < len(tokens) else "" for j in (i - 1 - negative, i + 1))
        if {before, after} & _RANGE or before == "and" and "between" in {t[2] for t in tokens[max(0, i - 3):i]}:
            exact = exact + near  # a bound: rows should fall on it and just either side (off-by-one errors)
        columns = _column_of(i, tokens, refs)
        for key in columns:
            hints.exact.setdefault(key, []).extend(exact)
            hints.near.setdefault(key, []).extend(near)
        for k in () if columns else ("integer", "real") if kind == "num" else ("text", "date"):
            hints.loose.setdefault(k, []).extend(exact + near)  # e.g. HAVING COUNT(*) > 3: no column to pin
    group_by = [i for i in range(len(tokens) - 1) if tokens[i][2] == "group" and tokens[i + 1][2] == "by"]
    for i, keys in refs.items():
        if i + 2 in refs and tokens[i + 1][1] in ("=", "=="):
            hints.links += [(a, b) for a in keys for b in refs[i + 2]]
        if any(g < i and not {t[2] for t in tokens[g:i]} & _AFTER_GROUP_BY for g in group_by):
            hints.grouped |= keys
    return hints


def _column_of(i: int, tokens: list[tuple[str, str, str]], refs: dict[int, set[Key]]) -> set[Key]:
    """The column a literal is compared with: `col op literal`, `col IN (...)`, `col BETWEEN a AND b`, `lit op col`."""
    j = i - 1
    while j >= 0 and j not in refs and (tokens[j][0] in ("num", "str") or tokens[j][2].upper() in _LITERAL_TO_COLUMN
                                        or tokens[j][2] == "and" and j >= 2 and tokens[j - 2][2] == "between"):
        j -= 1
    if j in refs:
        return refs[j]
    return refs.get(i + 2, set()) if i + 1 < len(tokens) and tokens[i + 1][1] in _COMPARE else set()


# ---------------------------------------------------------------- filling one database

def _as_date(value: object) -> dt.date:
    with contextlib.suppress(TypeError, ValueError):
        return dt.date.fromisoformat(value)  # type: ignore[arg-type]
    return dt.date(2015, 1, 1)


def _base_values(col: _Column, count: int, centres: list, rng: random.Random) -> list:
    """``count`` values of the column's kind, around the gold's literals where it has some."""
    out: list = []
    for i in range(count):
        centre = rng.choice(centres) if centres else None
        if col.kind in ("integer", "real"):
            c = centre if isinstance(centre, int | float) else 10
            spread = max(2.0 if col.kind == "integer" else 1.0, abs(c) / 2)
            value = rng.uniform(c - spread, c + spread)
            out.append(round(value) if col.kind == "integer" else round(value, 2))
        elif col.kind == "date":
            out.append((_as_date(centre) + dt.timedelta(days=rng.randint(-1500, 1500))).isoformat())
        else:
            out.append(f"{rng.choice(_WORDS)} {i + 1}" if col.key else rng.choice(_WORDS))
    return out


def _link(tables: dict[str, _Table], hints: _Hints) -> dict[Key, Key]:
    """Turn the gold's `a = b` column pairs into foreign keys (one side a key) or shared pools (column -> root)."""
    roots: dict[Key, Key] = {}
    for a, b in hints.links:
        key_a, key_b = (next(c.key for c in tables[t].columns if c.name.lower() == name) for t, name in (a, b))
        if key_b and not key_a:
            tables[a[0]].refs.setdefault(a[1], b)
        elif key_a and not key_b:
            tables[b[0]].refs.setdefault(b[1], a)
        else:
            roots[b] = roots.get(a, a)
    return roots


def _fill_order(tables: dict[str, _Table]) -> list[str]:
    """Referenced tables before the tables that reference them; cycles keep schema order."""
    order: list[str] = []
    pending = list(tables)
    while pending:
        ready = [t for t in pending if all(p in order or p == t for p, _ in tables[t].refs.values())] or pending[:1]
        order.append(ready[0])
        pending.remove(ready[0])
    return order


def _fill(conn: sqlite3.Connection, tables: dict[str, _Table], hints: _Hints, roots: dict[Key, Key],
          rng: random.Random) -> None:
    """Insert 3-12 generated rows into every table of ``conn``, referenced tables first."""
    null_rate = rng.choice((0.0, 0.0, 0.15))  # some databases without NULLs, so NULLs are not all they test
    pools: dict[Key, list] = {}
    for t in _fill_order(tables):
        table, n_rows = tables[t], rng.randint(3, 12)
        columns = []
        for col in table.columns:
            key = (t, col.name.lower())
            exact, near = hints.exact.get(key, []), hints.near.get(key, [])
            parent = table.refs.get(key[1])
            referenced = [r[0] for r in conn.execute(
                f"SELECT DISTINCT {_q(parent[1])} FROM {_q(tables[parent[0]].name)} WHERE {_q(parent[1])} IS NOT NULL"
            )] if parent else []
            if col.key:
                columns.append(_key_values(conn, table, col, exact, referenced, n_rows, rng))
                continue
            root = roots.get(key, key)
            if root not in pools:
                loose = hints.loose.get(col.kind, [])
                size = rng.choice((1, 2, 3) if root in hints.grouped else (1, 2, 3, 4, 6, 8))
                pools[root] = _base_values(col, size, exact or loose, rng) + loose
            pool = referenced or pools[root] + exact + near
            columns.append([None if col.nullable and rng.random() < null_rate
                            else rng.choice(exact) if exact and rng.random() < _EXACT_SHARE else rng.choice(pool)
                            for _ in range(n_rows)])
        names = ", ".join(_q(c.name) for c in table.columns)
        insert = f"INSERT OR IGNORE INTO {_q(table.name)} ({names}) VALUES ({', '.join('?' * len(columns))})"
        for row in zip(*columns, strict=True):
            with contextlib.suppress(sqlite3.Error, OverflowError):  # e.g. a CHECK or STRICT type the row breaks
                conn.execute(insert, row)
    conn.commit()


def _key_values(conn: sqlite3.Connection, table: _Table, col: _Column, exact: list, referenced: list,
                n_rows: int, rng: random.Random) -> list:
    """``n_rows`` values meant to be distinct: referenced ones, else some of the gold's literals and fresh ones."""
    if referenced:
        return (rng.sample(referenced, len(referenced)) * n_rows)[:n_rows]  # repeats are ignored on insert
    chosen = [v for v in exact if rng.random() < 0.5]
    if col.kind == "integer":
        top = conn.execute(f"SELECT MAX({_q(col.name)}) FROM {_q(table.name)}").fetchone()[0]
        start = top + 1 if isinstance(top, int) else 1
        fresh: list = list(range(start, start + n_rows))
    else:
        fresh = _base_values(col, n_rows, exact, rng)
    return (list(dict.fromkeys(chosen + fresh)) + [None] * n_rows)[:n_rows]
