"""Deterministic, seeded generator of text-to-SQL examples over small synthetic sqlite databases.

Every domain in :mod:`shardline.tasks.text_to_sql.domains` becomes a :class:`Database`; every query family
enumerates all of its (question, SQL) specs over those databases, and splits are drawn from the shuffled specs,
so no question can appear twice.
"""

from __future__ import annotations

import json
import random
import re
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from itertools import combinations
from pathlib import Path

from shardline.example import Example
from shardline.tasks.text_to_sql.domains import (
    DOMAINS,
    OPS,
    Column,
    Cond,
    Domain,
    Table,
    TableData,
    make_rows,
    show,
    thresholds,
)

FAMILIES: dict[str, float] = {  # query family -> sampling weight
    "select": 0.05, "where_eq": 0.10, "where_cmp": 0.10, "where_and": 0.09, "where_or": 0.08,
    "order_limit": 0.10, "aggregate": 0.12, "group_by": 0.09, "having": 0.07, "join": 0.12, "distinct": 0.08,
}

Render = Callable[[random.Random], tuple[str, str, tuple[str, ...]]]  # rng -> (question, sql, tables used)


@dataclass(frozen=True)
class Database:
    """A generated database: its schema and the rows of each table."""

    db_id: str
    create_statements: tuple[str, ...]
    rows: dict[str, tuple[tuple, ...]] = field(hash=False)

    def connect(self) -> sqlite3.Connection:
        """A new in-memory sqlite database holding all tables and rows."""
        conn = sqlite3.connect(":memory:")
        for statement in self.create_statements:
            conn.execute(statement)
        for table, rows in self.rows.items():
            conn.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' * len(rows[0]))})", rows)
        conn.commit()
        return conn


def generate_databases(seed: int) -> dict[str, Database]:
    """One database per domain, with 15-20 parent rows and 25-40 child rows drawn from ``seed``."""
    rng = random.Random(seed)
    databases = {}
    for dom in DOMAINS:
        n_parent = rng.randint(15, 20)
        rows = {dom.parent.name: make_rows(dom.parent, n_parent, 0, rng),
                dom.child.name: make_rows(dom.child, rng.randint(25, 40), n_parent, rng)}
        creates = (dom.parent.create_statement, dom.child.create_statement)
        databases[dom.db_id] = Database(dom.db_id, creates, rows)
    return databases


def query_family(sql: str) -> str:
    """The query family of a SQL string produced by this generator (used for per-family reporting)."""
    checks = (("join", r"\bJOIN\b"), ("having", r"\bHAVING\b"), ("group_by", r"\bGROUP BY\b"),
              ("distinct", r"\bDISTINCT\b"), ("order_limit", r"\bORDER BY\b"),
              ("aggregate", r"\b(COUNT|SUM|AVG|MIN|MAX)\("), ("where_and", r"\bAND\b"),
              ("where_or", r"\bOR\b"), ("where_eq", r"\bWHERE \w+ = "), ("where_cmp", r"\bWHERE\b"))
    return next((name for name, pattern in checks if re.search(pattern, sql, re.IGNORECASE)), "select")


def generate_splits(seed: int, n_train: int, n_validation: int, n_test: int) -> dict[str, list[Example]]:
    """Train/validation/test examples for ``seed``; every question text is unique across all splits.

    Families are drawn by weight and specs without replacement, test first, so validation and test follow the
    family mix exactly and only train feels a family running out. Raises ValueError if the space is too small.
    """
    if min(n_train, n_validation, n_test) < 0:
        raise ValueError("split sizes must be non-negative")
    databases = generate_databases(seed)
    pools = {family: [] for family in FAMILIES}
    for dom in DOMAINS:
        names = (dom.parent.name, dom.child.name)
        creates = dict(zip(names, databases[dom.db_id].create_statements, strict=True))
        for family, renders in _candidates(dom, databases[dom.db_id]).items():
            pools[family].extend((dom.db_id, creates, render) for render in renders)
    possible = sum(len(pool) for pool in pools.values())
    needed = n_train + n_validation + n_test
    too_many = (f"only {possible} unique questions are possible for seed {seed} but {needed} were requested; "
                "lower n_train (or n_validation / n_test)")
    if needed > possible:
        raise ValueError(too_many)
    rng = random.Random(seed)
    for pool in pools.values():
        rng.shuffle(pool)
    examples: list[Example] = []
    seen: set[str] = set()
    while len(examples) < needed:
        open_families = [family for family, pool in pools.items() if pool]
        if not open_families:
            raise ValueError(too_many.replace(str(possible), str(len(seen)), 1))
        family = rng.choices(open_families, [FAMILIES[f] for f in open_families])[0]
        db_id, creates, render = pools[family].pop()
        question, sql, tables = render(rng)
        if question not in seen:
            seen.add(question)
            context = "\n".join(create for table, create in creates.items() if table in tables)
            examples.append(Example(question, context, sql, db_id))
    return {"train": examples[n_test + n_validation:], "validation": examples[n_test:n_test + n_validation],
            "test": examples[:n_test]}


def write_jsonl(examples: list[Example], path: Path) -> None:
    """Write one JSON object per line with keys question, context, answer, db_id."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for example in examples:
            f.write(json.dumps(example.to_dict(), ensure_ascii=False) + "\n")


# ---------------------------------------------------------------- renderers (rng -> question, sql, tables)

def _and(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _targets(cols: tuple[Column, ...]) -> str:
    return cols[0].plural if len(cols) == 1 else _and([c.phrase for c in cols])


def _names(cols: tuple[Column, ...], alias: str = "") -> str:
    return ", ".join(alias + c.name for c in cols)


def _where(conds: tuple[Cond, ...], joiner: str = " AND ") -> str:
    return " WHERE " + joiner.join(c.sql() for c in conds) if conds else ""


def _suffix(conds: tuple[Cond, ...], rng: random.Random, joiner: str = " and ") -> str:
    return " " + joiner.join(c.text(rng) for c in conds) if conds else ""


def _fill(rng: random.Random, templates: tuple[str, ...], **words: object) -> str:
    return rng.choice(templates).format(**words)


def _select(t: Table, cols: tuple[Column, ...], rng: random.Random) -> tuple[str, str, tuple[str, ...]]:
    templates = ("List the {x} of all {pl}.", "Show the {x} of every {sg}.", "What are the {x} of the {pl}?",
                 "Give me the {x} of all {pl}.")
    question = _fill(rng, templates, x=_targets(cols), pl=t.name, sg=t.singular)
    return question, f"SELECT {_names(cols)} FROM {t.name}", (t.name,)


def _filter(t: Table, cols: tuple[Column, ...], conds: tuple[Cond, ...], joiner: str,
            rng: random.Random) -> tuple[str, str, tuple[str, ...]]:
    templates = ("List the {x} of {pl}{c}.", "Show the {x} of all {pl}{c}.",
                 "What are the {x} of the {pl}{c}?", "Give me the {x} of {pl}{c}.",
                 "Find the {x} of each {sg}{c}.")
    question = _fill(rng, templates, x=_targets(cols), pl=t.name, sg=t.singular,
                     c=_suffix(conds, rng, f" {joiner.lower()} "))
    return question, f"SELECT {_names(cols)} FROM {t.name}{_where(conds, f' {joiner} ')}", (t.name,)


def _order(t: Table, cols: tuple[Column, ...], col: Column, desc: bool, k: int | None,
           rng: random.Random) -> tuple[str, str, tuple[str, ...]]:
    hi, lo = ("latest", "earliest") if col.gen == "date" else ("highest", "lowest")
    only_label = (t.label,) == tuple(c.name for c in cols)
    if k is None:
        templates = ("List the {x} of all {pl} sorted by {p} in {d} order.",
                     "Show the {x} of {pl} ordered by {p} from {span}.",
                     "Sort the {pl} by {p} in {d} order and show their {x}.")
    elif k == 1:
        templates = ("What is the {x1} of the {sg} with the {w} {p}?",
                     "Find the {x1} of the {sg} that has the {w} {p}.")
        templates += ("Which {sg} has the {w} {p}?",) * only_label
    else:
        templates = ("List the {x} of the {k} {pl} with the {w} {p}.",
                     "Show the {x} of the {k} {pl} that have the {w} {p}.")
        templates += ("Which {k} {pl} have the {w} {p}?",) * only_label
    question = _fill(rng, templates, x=_targets(cols), x1=_and([c.phrase for c in cols]), pl=t.name,
                     sg=t.singular, p=col.phrase, k=k, w=hi if desc else lo,
                     d="descending" if desc else "ascending",
                     span=f"{hi} to {lo}" if desc else f"{lo} to {hi}")
    sql = f"SELECT {_names(cols)} FROM {t.name} ORDER BY {col.name} {'DESC' if desc else 'ASC'}"
    return question, sql + (f" LIMIT {k}" if k else ""), (t.name,)


_AGG_WORDS = {"SUM": ("total",), "AVG": ("average", "mean"), "MIN": ("minimum", "lowest"),
              "MAX": ("maximum", "highest")}
_DATE_WORDS = {"MIN": ("earliest",), "MAX": ("latest",)}


def _agg_word(func: str, col: Column, rng: random.Random) -> str:
    return rng.choice((_DATE_WORDS if col.gen == "date" else _AGG_WORDS)[func])


def _aggregate(t: Table, func: str, col: Column | None, conds: tuple[Cond, ...],
               rng: random.Random) -> tuple[str, str, tuple[str, ...]]:
    c = _suffix(conds, rng)
    if col is None:
        templates = ("Count the {pl}{c}.", "What is the number of {pl}{c}?", "How many {pl} are there{c}?")
        question, expr = _fill(rng, templates, pl=t.name, c=c), "COUNT(*)"
    else:
        templates = ("What is the {w} {p} of {pl}{c}?", "Find the {w} {p} among {pl}{c}.",
                     "Compute the {w} {p} of all {pl}{c}.")
        question = _fill(rng, templates, w=_agg_word(func, col, rng), p=col.phrase, pl=t.name, c=c)
        expr = f"{func}({col.name})"
    return question, f"SELECT {expr} FROM {t.name}{_where(conds)}", (t.name,)


def _group(t: Table, g: Column, func: str, col: Column | None, conds: tuple[Cond, ...],
           rng: random.Random) -> tuple[str, str, tuple[str, ...]]:
    c = _suffix(conds, rng)
    if col is None:
        templates = ("Count the {pl}{c} for each {g}.", "For each {g}, how many {pl}{c} are there?",
                     "Show the number of {pl}{c} per {g}.")
        question, expr = _fill(rng, templates, pl=t.name, c=c, g=g.phrase), "COUNT(*)"
    else:
        templates = ("What is the {w} {p} of {pl}{c} for each {g}?",
                     "For each {g}, find the {w} {p} of {pl}{c}.", "Show the {w} {p} of {pl}{c} per {g}.")
        question = _fill(rng, templates, w=_agg_word(func, col, rng), p=col.phrase, pl=t.name, c=c,
                         g=g.phrase)
        expr = f"{func}({col.name})"
    return question, f"SELECT {g.name}, {expr} FROM {t.name}{_where(conds)} GROUP BY {g.name}", (t.name,)


def _having(t: Table, g: Column, func: str, col: Column | None, op: str, value: object, with_count: bool,
            rng: random.Random) -> tuple[str, str, tuple[str, ...]]:
    if col is None:
        templates = ("Which {gs} have {m} {v} {pl}?", "List the {gs} shared by {m} {v} {pl}.",
                     "Find the {gs} with {m} {v} {pl}.")
        if with_count:
            templates = ("List each {g} with {m} {v} {pl} and its number of {pl}.",
                         "For the {gs} with {m} {v} {pl}, show the {g} and the number of {pl}.")
        m = "more than" if op == ">" else "fewer than"
    else:
        templates = ("Which {gs} have {a} {w} {p} {m} {v} among {pl}?",
                     "List the {gs} whose {pl} have {a} {w} {p} {m} {v}.",
                     "For which {g} is the {w} {p} of {pl} {m} {v}?")
        m = rng.choice(("above", "greater than") if op == ">" else ("below", "less than"))
    word = "average" if func == "AVG" else "total"
    question = _fill(rng, templates, gs=g.plural, g=g.phrase, m=m, v=show(value), pl=t.name, w=word,
                     a="an" if func == "AVG" else "a", p=col.phrase if col else "")
    expr = f"{func}({col.name if col else '*'})"
    select = f"{g.name}, {expr}" if with_count else g.name
    sql = f"SELECT {select} FROM {t.name} GROUP BY {g.name} HAVING {expr} {op} {show(value)}"
    return question, sql, (t.name,)


def _join(dom: Domain, variant: str, col: Column | None, cond: Cond,
          rng: random.Random) -> tuple[str, str, tuple[str, ...]]:
    child, parent = dom.child, dom.parent
    on_child = variant == "pair"
    pc = f"named {show(cond.value)}" if cond.column.name == parent.label and not on_child else cond.text(rng)
    child_label = child.column(child.label)
    words = dict(cl=child_label.plural, cl1=child_label.phrase, cpl=child.name, csg=child.singular,
                 link=dom.link, pc=pc, rel=dom.rel, pl1=parent.column(parent.label).phrase)
    if variant == "pair":
        templates = ("List the {cl1} of each {csg} {pc} together with the {pl1} of its {rel}.",
                     "For each {csg} {pc}, show its {cl1} and the {pl1} of its {rel}.")
        select = f"T1.{child.label}, T2.{parent.label}"
    elif variant == "list":
        templates = ("List the {cl} of {cpl} that {link} {pc}.", "Which {cpl} {link} {pc}?",
                     "Show the {cl} of all {cpl} that {link} {pc}.")
        select = f"T1.{child.label}"
    elif variant == "count":
        templates = ("How many {cpl} {link} {pc}?", "Count the {cpl} that {link} {pc}.",
                     "What is the number of {cpl} that {link} {pc}?")
        select = "COUNT(*)"
    else:
        templates = ("What is the {w} {p} of {cpl} that {link} {pc}?",
                     "Find the {w} {p} of all {cpl} that {link} {pc}.")
        words.update(w=_agg_word(variant, col, rng), p=col.phrase)
        select = f"{variant}(T1.{col.name})"
    sql = (f"SELECT {select} FROM {child.name} AS T1 JOIN {parent.name} AS T2 ON T1.{dom.fk.name} = T2.id "
           f"WHERE {cond.sql('T1.' if on_child else 'T2.')}")
    return _fill(rng, templates, **words), sql, (parent.name, child.name)


def _distinct(t: Table, g: Column, conds: tuple[Cond, ...], count: bool,
              rng: random.Random) -> tuple[str, str, tuple[str, ...]]:
    if count:
        templates = ("How many different {gs} do {pl}{c} have?", "Count the distinct {gs} among {pl}{c}.",
                     "What is the number of unique {gs} of {pl}{c}?")
        expr = f"COUNT(DISTINCT {g.name})"
    else:
        templates = ("What are the distinct {gs} of {pl}{c}?", "List the different {gs} among {pl}{c}.",
                     "Show each unique {g} of {pl}{c}.")
        expr = f"DISTINCT {g.name}"
    question = _fill(rng, templates, gs=g.plural, g=g.phrase, pl=t.name, c=_suffix(conds, rng))
    return question, f"SELECT {expr} FROM {t.name}{_where(conds)}", (t.name,)


# ---------------------------------------------------------------- enumeration of every spec of a domain

def _snap(col: Column, value: float) -> float | int:
    return round(value) if col.sql_type == "INTEGER" else round(round(value / col.step) * col.step, 2)


def _funcs(col: Column, *funcs: str) -> list[str]:
    """The aggregate functions that make sense for ``col`` (no SUM of ages, ratings...)."""
    return [f for f in funcs if f != "SUM" or col.summable]


def _having_specs(td: TableData, g: Column) -> list[tuple[str, Column | None, str, object]]:
    """(function, column, op, threshold) HAVING clauses over groups of ``g`` that keep at least one group."""
    groups: dict[object, list[int]] = {}
    for i, value in enumerate(td.values(g)):
        groups.setdefault(value, []).append(i)
    sizes = sorted({len(rows) for rows in groups.values()})
    specs = [("COUNT", None, op, k) for k in sizes for op in (">", "<")
             if OPS[op](sizes[-1 if op == ">" else 0], k)]
    for col in td.fields("number"):
        values = td.values(col)
        for func in _funcs(col, "AVG", "SUM"):
            aggs = [sum(values[i] for i in rows) / (len(rows) if func == "AVG" else 1)
                    for rows in groups.values()]
            specs += [(func, col, op, v) for v in thresholds([_snap(col, a) for a in aggs])
                      for op in (">", "<") if any(OPS[op](a, v) for a in aggs)]
    return specs


def _table_candidates(td: TableData, out: dict[str, list[Render]]) -> None:
    t = td.table
    label = t.column(t.label)
    fields, cats, measures = td.fields(), td.fields("choice"), td.fields("number")
    filters = td.filters()
    out["select"] += [partial(_select, t, cols) for r in (1, 2, 3, 4) for cols in combinations(fields, r)]
    for cond in filters + td.lookups():
        others = [f for f in fields if f not in (label, cond.column)]
        with_label = [(label,), *((label, f) for f in others)]
        targets = [(f,) for f in others] if cond.column is label else with_label
        family = "where_eq" if cond.op == "=" else "where_cmp"
        out[family] += [partial(_filter, t, cols, (cond,), "AND") for cols in targets]
    filters = [c for c in filters if c.column is not label]
    for a, b in combinations(filters, 2):
        if (a.column is not b.column or {a.op, b.op} == {">", "<"}) and a.rows & b.rows:
            out["where_and"].append(partial(_filter, t, (label,), (a, b), "AND"))
        if a.column is not b.column or not a.rows & b.rows:  # same column only for disjoint ranges
            out["where_or"].append(partial(_filter, t, (label,), (a, b), "OR"))
    for col in td.fields("number", "date"):
        out["order_limit"] += [partial(_order, t, cols, col, desc, k) for cols in ((label,), (label, col))
                               for desc in (True, False) for k in (None, 1, 3, 5, 10)]
    aggs = [("COUNT", None)] + [(f, c) for c in measures for f in _funcs(c, "SUM", "AVG", "MIN", "MAX")]
    aggs += [(f, c) for c in td.fields("date") for f in ("MIN", "MAX")]
    for func, col in aggs:
        out["aggregate"] += [partial(_aggregate, t, func, col, conds)
                             for conds in [()] + [(c,) for c in filters if c.column is not col]]
    for g in cats:
        group_aggs = [("COUNT", None)] + [(f, c) for c in measures for f in _funcs(c, "AVG", "SUM", "MAX")]
        for func, col in group_aggs:
            out["group_by"] += [partial(_group, t, g, func, col, conds)
                                for conds in [()] + [(c,) for c in filters if c.column not in (g, col)]]
        out["having"] += [partial(_having, t, g, func, col, op, v, with_count) for func, col, op, v in
                          _having_specs(td, g) for with_count in (False, True)[:1 + (col is None)]]
        out["distinct"] += [partial(_distinct, t, g, conds, count) for count in (False, True)
                            for conds in [()] + [(c,) for c in filters if c.column is not g]]


def _candidates(dom: Domain, db: Database) -> dict[str, list[Render]]:
    """Every question spec of every family over one domain's database."""
    out: dict[str, list[Render]] = {family: [] for family in FAMILIES}
    parent = TableData(dom.parent, db.rows[dom.parent.name])
    child = TableData(dom.child, db.rows[dom.child.name])
    for td in (parent, child):
        _table_candidates(td, out)
    fk_values = child.values(dom.fk)
    for cond in parent.filters() + parent.lookups():
        parent_ids = {parent.rows[i][0] for i in cond.rows}
        if any(v in parent_ids for v in fk_values):
            variants = [("list", None), ("count", None)]
            variants += [(f, c) for c in child.fields("number") for f in _funcs(c, "AVG", "SUM")]
            out["join"] += [partial(_join, dom, variant, col, cond) for variant, col in variants]
    label = dom.child.column(dom.child.label)
    out["join"] += [partial(_join, dom, "pair", None, c) for c in child.filters() if c.column is not label]
    return out
