"""The loop knows no objective (issue 56): every `train.objective` is a plug-in of `training/objectives/`, and
`training/trainer.py` never names one. Their numbers are test_objective_golden.py's and test_objective_matrix.py's."""

from __future__ import annotations

import ast
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


def test_every_objective_the_spec_allows_has_one_file_in_the_registry():
    allowed = set(typing.get_args(Objective))
    registry = ast.parse((SRC / "objectives" / "__init__.py").read_text())
    imported = {node.module.rpartition(".")[2] for node in ast.walk(registry) if isinstance(node, ast.ImportFrom)
                and node.module and node.module.startswith("shardline.training.objectives.")} - {"base"}
    assert imported == allowed
    assert all((SRC / "objectives" / f"{name}.py").exists() for name in allowed)
