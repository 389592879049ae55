"""Fault injection for tests and failure drills: `SHARDLINE_FAULT=<point>[:rank=R][:step=S]`.

At the named point (`train_step`, `validation`, `checkpoint`, `sql_evaluation`) the matching rank raises
`InjectedFault`, exactly as a real error would surface there. Unset (always, outside drills), it does nothing.
"""

from __future__ import annotations

import os

POINTS = ("train_step", "validation", "checkpoint", "sql_evaluation")


class InjectedFault(RuntimeError):
    """The error a `SHARDLINE_FAULT` drill raises."""


def maybe_fail(point: str, rank: int, step: int) -> None:
    spec = os.environ.get("SHARDLINE_FAULT")
    if not spec:
        return
    name, *conditions = spec.split(":")
    if name not in POINTS:
        raise ValueError(f"SHARDLINE_FAULT={spec!r}: unknown point {name!r}; choose from {', '.join(POINTS)}")
    wanted = dict(c.split("=", 1) for c in conditions)
    if name == point and int(wanted.get("rank", rank)) == rank and int(wanted.get("step", step)) == step:
        raise InjectedFault(f"injected fault at {point} (rank {rank}, step {step})")
