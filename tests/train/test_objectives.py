"""The loop knows no objective (issue 56): every `train.objective` is a plug-in of `training/objectives/`, and
`training/trainer.py` never names one. Their numbers are test_objective_golden.py's and test_objective_matrix.py's."""

from __future__ import annotations

import importlib
import re
import typing
from pathlib import Path

from shardline.spec.sections import Objective
from shardline.training import objectives

SRC = Path(objectives.__file__).resolve().parents[1]


def test_the_loop_names_no_objective():
    text = (SRC / "trainer.py").read_text()
    named = sorted({m.group(0) for m in re.finditer(r"\b(sft|dpo|grpo|preference|rollouts?)\b", text, re.I)})
    assert named == [], f"trainer.py names an objective: {named}"


def test_every_objective_the_spec_allows_is_one_module_that_exports_it_and_nothing_else_registers_it():
    """`build` imports the module the spec names; each module's OBJECTIVE has every method of the protocol, and the
    registry names no objective (adding one is its file)."""
    allowed = set(typing.get_args(Objective))
    modules = {p.stem for p in (SRC / "objectives").glob("*.py")} - {"__init__", "base", "reference"}
    assert modules == allowed
    protocol = {name for name, member in vars(objectives.Objective).items()
                if callable(member) and not name.startswith("_")}
    for name in allowed:
        cls = importlib.import_module(f"shardline.training.objectives.{name}").OBJECTIVE
        assert protocol <= set(dir(cls)), (name, protocol - set(dir(cls)))
    registry = (SRC / "objectives" / "__init__.py").read_text()
    assert not re.search(r"\b(sft|dpo|grpo)\b", registry.split('"""', 4)[-1], re.I)
