"""Preference pairs for the generated set (`train.objective: dpo`): the gold SQL chosen, a wrong query rejected.

The rejected query is a near miss of the gold one — a comparison, aggregate, sort direction, limit or connective
flipped, or the filter dropped — kept only when it runs on the question's database and returns a different result
from the gold query's; failing every edit, another question's query on the same database is taken. So each pair
prefers what execution accuracy counts as right over something it counts as wrong.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import replace

from shardline.example import Example
from shardline.tasks.text_to_sql.execution import order_matters, results_match, run_sql
from shardline.tasks.text_to_sql.generate import generate_databases

_FLIP_OPERATOR = {">": "<", "<": ">", ">=": "<=", "<=": ">=", "=": "!=", "!=": "="}
_FLIP_AGGREGATE = {"MAX": "MIN", "MIN": "MAX", "AVG": "SUM", "SUM": "AVG"}


def _operator(sql: str) -> str:
    return re.sub(r"(?<=\s)(>=|<=|!=|>|<|=)(?=\s)", lambda m: _FLIP_OPERATOR[m.group(1)], sql, count=1)


def _aggregate(sql: str) -> str:
    return re.sub(r"\b(MAX|MIN|AVG|SUM)\(", lambda m: _FLIP_AGGREGATE[m.group(1)] + "(", sql, count=1)


def _direction(sql: str) -> str:
    if " DESC" in sql:
        return sql.replace(" DESC", " ASC", 1)
    return re.sub(r"(ORDER BY [\w.]+(?:\([^)]*\))?)( ASC)?", r"\1 DESC", sql, count=1)


def _limit(sql: str) -> str:
    return re.sub(r"LIMIT (\d+)", lambda m: f"LIMIT {int(m.group(1)) + 1}", sql, count=1)


def _connective(sql: str) -> str:
    if " AND " in sql and " ON " not in sql.split(" AND ")[0][-40:]:
        return sql.replace(" AND ", " OR ", 1)
    return sql.replace(" OR ", " AND ", 1)


def _no_filter(sql: str) -> str:
    return re.sub(r" WHERE .*?(?= GROUP BY| ORDER BY| LIMIT|$)", "", sql, count=1)


EDITS: tuple[Callable[[str], str], ...] = (_operator, _aggregate, _direction, _limit, _connective, _no_filter)


def with_rejected(splits: dict[str, list[Example]], seed: int) -> dict[str, list[Example]]:
    """Every example of every split with a rejected query beside its gold answer (the chosen one)."""
    databases = generate_databases(seed)
    connections = {db_id: db.connect() for db_id, db in databases.items()}
    by_db: dict[str, list[str]] = {}
    for examples in splits.values():
        for ex in examples:
            by_db.setdefault(ex.db_id, []).append(ex.answer)
    try:
        out = {}
        for name, examples in splits.items():
            rng = random.Random(f"{seed}:{name}")
            out[name] = [replace(ex, rejected=_rejected(ex, connections[ex.db_id], by_db[ex.db_id], rng))
                         for ex in examples]
        return out
    finally:
        for conn in connections.values():
            conn.close()


def _rejected(ex: Example, conn, same_db: list[str], rng: random.Random) -> str:
    gold = run_sql(conn, ex.answer)
    ordered = order_matters(ex.answer)
    edits = list(EDITS)
    rng.shuffle(edits)
    others = rng.sample(same_db, min(len(same_db), 8))
    for candidate in [edit(ex.answer) for edit in edits] + others:
        if candidate == ex.answer:
            continue
        result = run_sql(conn, candidate)
        if result.rows is not None and not results_match(result, gold, ordered):
            return candidate
    raise ValueError(f"no wrong query found for {ex.question!r} on {ex.db_id}")
