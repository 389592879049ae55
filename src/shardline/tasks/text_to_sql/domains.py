"""Schemas, value pools, row generation and WHERE predicates for the synthetic text-to-SQL databases.

Each domain has a parent table and a child table whose foreign key points at the parent's ``id``.
"""

from __future__ import annotations

import datetime as dt
import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    """A column and how its values are generated (``gen``: id, fk, unique, choice, number or date).

    ``summable`` is False for numbers whose total means nothing (ages, ratings).
    """

    name: str
    sql_type: str
    gen: str
    phrase: str = ""
    pool: tuple[str, ...] = ()
    low: float = 0
    high: float = 0
    step: float = 1
    plural_phrase: str = ""
    summable: bool = True

    @property
    def plural(self) -> str:
        """Plural of the column's natural-language phrase."""
        if self.plural_phrase:
            return self.plural_phrase
        if self.phrase.endswith("s"):
            return self.phrase
        if self.phrase.endswith("y") and self.phrase[-2:-1] not in "aeiou":
            return self.phrase[:-1] + "ies"
        return self.phrase + "s"


@dataclass(frozen=True)
class Table:
    """A table, the nouns naming its rows, and its label column (the one that names a row)."""

    name: str
    singular: str
    label: str
    columns: tuple[Column, ...]

    @property
    def create_statement(self) -> str:
        """Compact one-line CREATE TABLE statement."""
        return f"CREATE TABLE {self.name} ({', '.join(_column_ddl(c) for c in self.columns)})"

    def column(self, name: str) -> Column:
        """The column called ``name``."""
        return next(c for c in self.columns if c.name == name)


@dataclass(frozen=True)
class Domain:
    """Two related tables; ``link`` is a plural verb phrase from child to parent, ``rel`` names the parent."""

    db_id: str
    parent: Table
    child: Table
    link: str
    rel: str

    @property
    def fk(self) -> Column:
        """The child's foreign-key column."""
        return next(c for c in self.child.columns if c.gen == "fk")


def _column_ddl(col: Column) -> str:
    return f"{col.name} {col.sql_type}" + (f" REFERENCES {col.pool[0]}(id)" if col.gen == "fk" else "")


def _id() -> Column:
    return Column("id", "INTEGER", "id", "id")


def _fk(name: str, parent: str) -> Column:
    return Column(name, "INTEGER", "fk", name, pool=(parent,))


def _text(name: str, phrase: str, pool: tuple[str, ...], unique: bool = False, plural: str = "") -> Column:
    return Column(name, "TEXT", "unique" if unique else "choice", phrase, pool, plural_phrase=plural)


def _num(name: str, sql_type: str, phrase: str, low: float, high: float, step: float = 1,
         summable: bool = True) -> Column:
    return Column(name, sql_type, "number", phrase, low=low, high=high, step=step, summable=summable)


def _date(name: str, phrase: str, first_year: int, last_year: int) -> Column:
    return Column(name, "DATE", "date", phrase, low=first_year, high=last_year)


_FIRST = ("Alice", "Bruno", "Carla", "David", "Elena", "Farid", "Grace", "Hugo", "Irene", "Jonas", "Kira",
          "Liam", "Maya", "Nikos", "Olga", "Pedro", "Quinn", "Rosa", "Sven", "Tara", "Umar", "Vera")
_LAST = ("Adams", "Baker", "Costa", "Dubois", "Evans", "Fischer", "Garcia", "Hansen", "Ivanov", "Jensen",
         "Klein", "Lopez", "Moreau", "Novak", "Okafor", "Petrov", "Rossi", "Silva", "Tanaka", "Weber")
PEOPLE = tuple(f"{first} {last}" for first in _FIRST for last in _LAST)
_ADJ = ("Silent", "Golden", "Broken", "Hidden", "Endless", "Crimson", "Distant", "Frozen", "Wild", "Quiet",
        "Burning", "Lost")
_NOUN = ("River", "Garden", "Empire", "Harbor", "Forest", "Mirror", "Voyage", "Storm", "Island", "Signal",
         "Lantern", "Horizon")
TITLES = tuple(f"{adj} {noun}" for adj in _ADJ for noun in _NOUN)
CITIES = ("Paris", "Berlin", "Madrid", "Oslo", "Lisbon", "Vienna", "Dublin", "Prague")
COUNTRIES = ("France", "Germany", "Spain", "Norway", "Italy", "Canada", "Japan", "Brazil")

DOMAINS: tuple[Domain, ...] = (
    Domain("company", Table("departments", "department", "name", (
        _id(), _text("name", "name", ("Sales", "Engineering", "Marketing", "Finance", "Legal", "Support",
                                      "Research", "Operations", "Design", "Security", "Logistics", "Training",
                                      "Quality", "Facilities", "Analytics", "Compliance", "Media", "Strategy",
                                      "Procurement", "Payroll"), unique=True),
        _text("city", "city", CITIES), _num("budget", "REAL", "budget", 50000, 900000, 5000),
        _date("founded", "founding date", 1985, 2015))),
        Table("employees", "employee", "name", (
            _id(), _text("name", "name", PEOPLE, unique=True), _fk("department_id", "departments"),
            _text("title", "job title", ("Engineer", "Manager", "Analyst", "Designer", "Clerk", "Director")),
            _num("salary", "REAL", "salary", 30000, 150000, 500),
            _num("age", "INTEGER", "age", 22, 64, summable=False),
            _date("hired", "hire date", 2005, 2023))),
        "work in a department", "department"),
    Domain("shop", Table("customers", "customer", "name", (
        _id(), _text("name", "name", PEOPLE, unique=True), _text("country", "country", COUNTRIES),
        _text("tier", "membership tier", ("Gold", "Silver", "Bronze")),
        _date("joined", "join date", 2015, 2023))),
        Table("orders", "order", "product", (
            _id(), _fk("customer_id", "customers"),
            _text("product", "product", ("Desk Lamp", "Office Chair", "Notebook", "Monitor", "Keyboard",
                                         "Headphones", "Backpack", "Water Bottle", "Printer", "Webcam")),
            _num("quantity", "INTEGER", "quantity", 1, 12), _num("price", "REAL", "price", 5, 400, 0.5),
            _date("order_date", "order date", 2023, 2024))),
        "were placed by a customer", "customer"),
    Domain("school", Table("courses", "course", "title", (
        _id(), _text("title", "title", ("Algebra", "Biology", "Chemistry", "Physics", "Geometry", "Poetry",
                                        "Drawing", "Economics", "Statistics", "Philosophy", "Sculpture",
                                        "Genetics", "Astronomy", "Spanish", "German", "Latin", "Ecology",
                                        "Calculus", "Rhetoric", "Ceramics"), unique=True),
        _text("subject", "subject", ("Math", "Science", "Arts", "Humanities", "Languages")),
        _num("credits", "INTEGER", "credit count", 1, 6), _date("start_date", "start date", 2022, 2024))),
        Table("students", "student", "name", (
            _id(), _text("name", "name", PEOPLE, unique=True), _fk("course_id", "courses"),
            _num("age", "INTEGER", "age", 17, 30, summable=False),
            _num("gpa", "REAL", "GPA", 1.5, 4.0, 0.1, summable=False),
            _text("city", "home city", CITIES), _date("enrolled", "enrollment date", 2018, 2024))),
        "are enrolled in a course", "course"),
    Domain("travel", Table("airports", "airport", "name", (
        _id(), _text("name", "name", tuple(f"{p} Airport" for p in (
            "Northfield", "Lakeside", "Redhill", "Seaview", "Stonebridge", "Westmoor", "Eastwick",
            "Highcliff", "Kingsport", "Riverton", "Pinecrest", "Goldcoast", "Marlow", "Ashford", "Brookvale",
            "Fairhaven",
            "Oakridge", "Silverdale", "Thornbury", "Windmere")), unique=True),
        _text("country", "country", COUNTRIES),
        _num("elevation", "INTEGER", "elevation", 0, 2500, 10, summable=False),
        _date("opened", "opening date", 1950, 2010))),
        Table("flights", "flight", "code", (
            _id(), _text("code", "code", tuple(f"FL{n}" for n in range(100, 400, 7)), unique=True),
            _fk("airport_id", "airports"),
            _text("airline", "airline", ("SkyJet", "AirNova", "BlueWing", "Pacifica", "Nordair")),
            _num("distance", "INTEGER", "distance", 200, 9000, 50),
            _num("price", "REAL", "ticket price", 50, 1500, 5),
            _date("departure", "departure date", 2024, 2024))),
        "depart from an airport", "airport"),
    Domain("library", Table("authors", "author", "name", (
        _id(), _text("name", "name", PEOPLE, unique=True), _text("country", "country", COUNTRIES),
        _num("awards", "INTEGER", "award count", 0, 9), _date("born", "birth date", 1940, 1995))),
        Table("books", "book", "title", (
            _id(), _text("title", "title", TITLES, unique=True), _fk("author_id", "authors"),
            _text("genre", "genre", ("Fantasy", "Mystery", "Romance", "History", "Poetry", "Science")),
            _num("pages", "INTEGER", "page count", 90, 900, 10), _num("price", "REAL", "price", 5, 60, 0.5),
            _date("published", "publication date", 1980, 2023))),
        "were written by an author", "author"),
    Domain("hospital", Table("doctors", "doctor", "name", (
        _id(), _text("name", "name", PEOPLE, unique=True),
        _text("specialty", "specialty", ("Cardiology", "Neurology", "Pediatrics", "Oncology", "Surgery"),
              plural="specialties"),
        _num("experience", "INTEGER", "experience", 1, 35, summable=False),
        _date("hired", "hire date", 1995, 2023))),
        Table("patients", "patient", "name", (
            _id(), _text("name", "name", PEOPLE, unique=True), _fk("doctor_id", "doctors"),
            _num("age", "INTEGER", "age", 1, 95, summable=False), _text("city", "city", CITIES),
            _num("bill", "REAL", "bill", 100, 20000, 10), _date("admitted", "admission date", 2022, 2024))),
        "are treated by a doctor", "doctor"),
    Domain("music", Table("artists", "artist", "name", (
        _id(), _text("name", "name", ("The Comets", "Velvet Sky", "Iron Tide", "Neon Fox", "Paper Moons",
                                      "Echo Valley", "Red Lanterns", "Glass Birds", "Night Owls",
                                      "Sun Riders",
                                      "Blue Harbor", "Static Hearts", "Wild Orchids", "Copper Kings",
                                      "Silver Lining", "Stone Garden", "Polar Lights", "Jade Rabbit",
                                      "Midnight Choir", "Desert Rose"), unique=True),
        _text("genre", "genre", ("Rock", "Jazz", "Pop", "Folk", "Electronic")),
        _text("country", "country", COUNTRIES), _date("formed", "formation date", 1965, 2018))),
        Table("albums", "album", "title", (
            _id(), _text("title", "title", TITLES, unique=True), _fk("artist_id", "artists"),
            _num("tracks", "INTEGER", "track count", 6, 20),
            _num("rating", "REAL", "rating", 1.0, 5.0, 0.1, summable=False),
            _num("sales", "INTEGER", "sales", 1000, 900000, 1000),
            _date("released", "release date", 1970, 2023))),
        "were released by an artist", "artist"),
    Domain("sports", Table("teams", "team", "name", (
        _id(), _text("name", "name", ("Eagles", "Tigers", "Wolves", "Falcons", "Sharks", "Bears", "Lions",
                                      "Hawks", "Panthers", "Rhinos", "Vipers", "Ravens", "Bulls", "Dragons",
                                      "Cobras", "Stallions", "Owls", "Foxes", "Bisons", "Jaguars"),
              unique=True),
        _text("city", "city", CITIES), _num("capacity", "INTEGER", "stadium capacity", 5000, 80000, 500),
        _date("founded", "founding date", 1890, 2005))),
        Table("players", "player", "name", (
            _id(), _text("name", "name", PEOPLE, unique=True), _fk("team_id", "teams"),
            _text("position", "position", ("Goalkeeper", "Defender", "Midfielder", "Forward")),
            _num("age", "INTEGER", "age", 18, 38, summable=False),
            _num("goals", "INTEGER", "goal count", 0, 40),
            _num("salary", "REAL", "salary", 20000, 900000, 1000))),
        "play for a team", "team"),
)


def _value(col: Column, rng: random.Random) -> object:
    if col.gen == "choice":
        return rng.choice(col.pool)
    if col.gen == "number":
        value = col.low + col.step * rng.randint(0, round((col.high - col.low) / col.step))
        return round(float(value), 2) if col.sql_type == "REAL" else int(value)
    start = dt.date(int(col.low), 1, 1)
    span = (dt.date(int(col.high), 12, 31) - start).days
    return (start + dt.timedelta(days=rng.randint(0, span))).isoformat()


def make_rows(table: Table, n_rows: int, n_parent_rows: int, rng: random.Random) -> tuple[tuple, ...]:
    """Generate ``n_rows`` rows for ``table``; ``n_parent_rows`` bounds its foreign-key values."""
    columns: list[list[object]] = []
    for col in table.columns:
        if col.gen == "id":
            columns.append(list(range(1, n_rows + 1)))
        elif col.gen == "fk":
            columns.append([rng.randint(1, n_parent_rows) for _ in range(n_rows)])
        elif col.gen == "unique":
            columns.append(rng.sample(col.pool, n_rows))
        else:
            columns.append([_value(col, rng) for _ in range(n_rows)])
    return tuple(zip(*columns, strict=True))


# ---------------------------------------------------------------- predicates

_COND_TEXT = {
    "=": ("whose {p} is {v}", "with {p} {v}"),
    ">": ("whose {p} is greater than {v}", "with {p} above {v}", "with {p} over {v}"),
    "<": ("whose {p} is less than {v}", "with {p} below {v}", "with {p} under {v}"),
    "after": ("whose {p} is after {v}", "with {p} later than {v}"),
    "before": ("whose {p} is before {v}", "with {p} earlier than {v}"),
}
OPS: dict[str, Callable[[object, object], bool]] = {
    "=": lambda a, b: a == b, ">": lambda a, b: a > b, "<": lambda a, b: a < b}


def show(value: object) -> str:
    """How a value is written in a question (floats without trailing zeros)."""
    return f"{value:.2f}".rstrip("0").rstrip(".") if isinstance(value, float) else str(value)


def literal(value: object) -> str:
    """How a value is written in SQL."""
    return f"'{value}'" if isinstance(value, str) else show(value)


@dataclass(frozen=True)
class Cond:
    """A WHERE predicate ``column op value`` and the row indices it matches."""

    column: Column
    op: str
    value: object
    rows: frozenset[int]

    def sql(self, alias: str = "") -> str:
        """The predicate in SQL, columns prefixed with ``alias``."""
        return f"{alias}{self.column.name} {self.op} {literal(self.value)}"

    def text(self, rng: random.Random) -> str:
        """The predicate as an English relative clause, e.g. "whose salary is above 50000"."""
        key = {">": "after", "<": "before"}.get(self.op, self.op) if self.column.gen == "date" else self.op
        return rng.choice(_COND_TEXT[key]).format(p=self.column.phrase, v=show(self.value))


def thresholds(values: list) -> list:
    """Up to five comparison thresholds at the 20th-80th percentiles of the distinct values."""
    distinct = sorted(set(values))
    return sorted({distinct[round(q * (len(distinct) - 1))] for q in (0.2, 0.35, 0.5, 0.65, 0.8)})


@dataclass(frozen=True)
class TableData:
    """A table with its rows and the predicates worth asking about."""

    table: Table
    rows: tuple[tuple, ...]

    def values(self, col: Column) -> list:
        """The column's values, in row order."""
        return [row[self.table.columns.index(col)] for row in self.rows]

    def cond(self, col: Column, op: str, value: object) -> Cond:
        """The predicate ``col op value`` with the rows it matches."""
        matches = frozenset(i for i, v in enumerate(self.values(col)) if OPS[op](v, value))
        return Cond(col, op, value, matches)

    def filters(self) -> list[Cond]:
        """Predicates on category, number and date columns that match at least one row."""
        conds = []
        for col in self.table.columns:
            if col.gen == "choice":
                conds += [self.cond(col, "=", v) for v in sorted(set(self.values(col)))]
            elif col.gen in ("number", "date"):
                ops = ("=", ">", "<") if col.sql_type == "INTEGER" else (">", "<")
                conds += [self.cond(col, op, v) for v in thresholds(self.values(col)) for op in ops]
        return [c for c in conds if c.rows]

    def lookups(self) -> list[Cond]:
        """Equality predicates on unique text columns (one per row)."""
        return [self.cond(c, "=", v) for c in self.table.columns if c.gen == "unique" for v in self.values(c)]

    def fields(self, *gens: str) -> list[Column]:
        """Columns generated as one of ``gens`` (default: every column except id and foreign key)."""
        return [c for c in self.table.columns if c.gen in (gens or ("unique", "choice", "number", "date"))]
