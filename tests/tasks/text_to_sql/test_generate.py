import json
import re
from collections import Counter

import pytest

from shardline.tasks.text_to_sql.execution import run_sql
from shardline.tasks.text_to_sql.generate import (
    FAMILIES,
    Database,
    Example,
    generate_databases,
    generate_splits,
    query_family,
    write_jsonl,
)

SEED = 1234
SIZES = {"train": 5000, "validation": 300, "test": 300}


@pytest.fixture(scope="module")
def splits() -> dict[str, list[Example]]:
    return generate_splits(SEED, SIZES["train"], SIZES["validation"], SIZES["test"])


@pytest.fixture(scope="module")
def databases() -> dict[str, Database]:
    return generate_databases(SEED)


@pytest.fixture(scope="module")
def results(splits, databases):
    """Gold results per split, each gold SQL run through the evaluation sandbox on its database."""
    conns = {db_id: db.connect() for db_id, db in databases.items()}
    return {name: [run_sql(conns[e.db_id], e.answer) for e in examples] for name, examples in splits.items()}


def test_splits_have_the_requested_sizes(splits):
    assert {name: len(examples) for name, examples in splits.items()} == SIZES


def test_same_seed_same_examples():
    assert generate_splits(7, 300, 30, 30) == generate_splits(7, 300, 30, 30)
    assert generate_databases(7) == generate_databases(7)


def test_different_seed_different_examples():
    assert generate_splits(7, 300, 30, 30)["train"] != generate_splits(8, 300, 30, 30)["train"]
    assert generate_databases(7)["company"].rows != generate_databases(8)["company"].rows


def test_splits_share_no_question(splits):
    questions = {name: {e.question for e in examples} for name, examples in splits.items()}
    assert not questions["train"] & questions["validation"]
    assert not questions["train"] & questions["test"]
    assert not questions["validation"] & questions["test"]


def test_no_question_repeats_inside_a_split(splits):
    for examples in splits.values():
        assert len({e.question for e in examples}) == len(examples)


def test_every_gold_sql_executes_on_its_database(splits, results):
    for name, examples in splits.items():
        failures = [(e.answer, r.error) for e, r in zip(examples, results[name], strict=True) if r.error]
        assert not failures, f"{name}: {failures[:3]}"


def test_most_gold_queries_return_rows(results):
    for name, split_results in results.items():
        non_empty = sum(bool(r.rows) for r in split_results)
        assert non_empty >= 0.8 * len(split_results), name


def test_all_query_families_present(splits):
    for name, examples in splits.items():
        counts = Counter(query_family(e.answer) for e in examples)
        assert set(counts) == set(FAMILIES), name
        if name == "train":
            assert min(counts.values()) >= 0.03 * len(examples), counts


def test_sql_uses_each_family_construct(splits):
    sql = [e.answer for e in splits["train"]]
    for pattern in (r" = '", r" < \d", r" > \d", r" > '\d{4}-", r" AND ", r" OR ", r"ORDER BY \w+ ASC LIMIT",
                    r"ORDER BY \w+ DESC LIMIT", r"COUNT\(\*\)", r"SUM\(", r"AVG\(", r"MIN\(", r"MAX\(",
                    r"GROUP BY \w+$", r"HAVING COUNT", r"HAVING AVG", r" JOIN .* WHERE ", r"SELECT DISTINCT"):
        assert any(re.search(pattern, s) for s in sql), pattern


def test_examples_span_all_databases(splits, databases):
    assert len(databases) >= 6
    for examples in splits.values():
        assert {e.db_id for e in examples} == set(databases)


def test_questions_and_sql_are_short(splits):
    for examples in splits.values():
        for e in examples:
            assert len(e.question.split()) < 25, e.question
            assert len(e.answer) < 200 and ";" not in e.answer, e.answer
            assert e.question[0].isupper() and e.question[-1] in ".?", e.question


def test_literals_in_sql_appear_verbatim_in_question(splits):
    for e in splits["train"]:
        literals = re.findall(r"'([^']*)'", e.answer) + re.findall(r"[=<>] (\d+(?:\.\d+)?)\b", e.answer)
        limit = re.search(r"LIMIT (\d+)", e.answer)
        if limit and limit[1] != "1":
            literals.append(limit[1])
        for literal in literals:
            assert literal in e.question, (e.question, e.answer)


def test_context_holds_exactly_the_tables_the_query_uses(splits, databases):
    for e in splits["train"]:
        used = set(re.findall(r"(?:FROM|JOIN) (\w+)", e.answer))
        lines = e.context.split("\n")
        assert {re.match(r"CREATE TABLE (\w+) \(", line)[1] for line in lines} == used
        assert set(lines) <= set(databases[e.db_id].create_statements)
        assert len(lines) == (2 if " JOIN " in e.answer else 1)


def test_databases_have_two_related_tables_with_realistic_types(databases):
    types = set()
    for db in databases.values():
        assert len(db.create_statements) == 2 and len(db.rows) == 2
        parent, child = db.rows.values()
        assert all(15 <= len(rows) <= 40 for rows in (parent, child))
        types |= set(re.findall(r"\b(INTEGER|REAL|TEXT|DATE)\b", " ".join(db.create_statements)))
        conn = db.connect()
        parent_table, child_table = db.rows
        fk = re.search(r"(\w+) INTEGER REFERENCES", db.create_statements[1])[1]
        orphans = conn.execute(f"SELECT COUNT(*) FROM {child_table} WHERE {fk} NOT IN "
                               f"(SELECT id FROM {parent_table})").fetchone()[0]
        assert orphans == 0
    assert types == {"INTEGER", "REAL", "TEXT", "DATE"}


def test_dates_are_stored_as_iso_text(databases):
    conn = databases["company"].connect()
    hired = [row[0] for row in conn.execute("SELECT hired FROM employees")]
    assert all(re.fullmatch(r"\d{4}-\d{2}-\d{2}", d) for d in hired)


def test_connect_builds_a_fresh_database_with_every_row(databases):
    for db in databases.values():
        conn = db.connect()
        for table, rows in db.rows.items():
            assert conn.execute(f"SELECT * FROM {table} ORDER BY id").fetchall() == list(rows)
    db = databases["company"]
    db.connect().execute("DELETE FROM employees")
    assert db.connect().execute("SELECT COUNT(*) FROM employees").fetchone()[0] == len(db.rows["employees"])


def test_asking_for_more_questions_than_exist_raises():
    with pytest.raises(ValueError, match=r"only \d+ unique questions are possible.*lower n_train"):
        generate_splits(SEED, 1_000_000, 10, 10)
    with pytest.raises(ValueError, match="non-negative"):
        generate_splits(SEED, 10, -1, 10)


def test_write_jsonl_writes_one_object_per_line(tmp_path, splits):
    path = tmp_path / "out" / "test.jsonl"
    write_jsonl(splits["test"], path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [e.to_dict() for e in splits["test"]]
    assert set(rows[0]) == {"question", "context", "answer", "db_id"}


def test_query_family_names_the_construct():
    assert query_family("SELECT name FROM t") == "select"
    assert query_family("SELECT name FROM t WHERE a = 'x'") == "where_eq"
    assert query_family("SELECT name FROM t WHERE a > 3") == "where_cmp"
    assert query_family("SELECT name FROM t WHERE a > 3 AND b = 'x'") == "where_and"
    assert query_family("SELECT name FROM t WHERE a > 3 OR b = 'x'") == "where_or"
    assert query_family("SELECT name FROM t ORDER BY a DESC LIMIT 3") == "order_limit"
    assert query_family("SELECT AVG(a) FROM t WHERE b = 'x'") == "aggregate"
    assert query_family("SELECT b, COUNT(*) FROM t GROUP BY b") == "group_by"
    assert query_family("SELECT b FROM t GROUP BY b HAVING COUNT(*) > 2") == "having"
    assert query_family("SELECT T1.a FROM t AS T1 JOIN u AS T2 ON T1.u_id = T2.id WHERE T2.b = 'x'") == "join"
    assert query_family("SELECT DISTINCT b FROM t") == "distinct"
