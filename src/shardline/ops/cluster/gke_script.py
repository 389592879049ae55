"""Plan steps (typed data) and their two renderings: an idempotent setup.sh and the teardown.sh that undoes it.

Setup runs `probe || create` for each step; teardown runs `probe && delete` for the steps that have a delete, in
reverse order, so both scripts can be re-run after a failure. Values reach the shell only as quoted variables or
constants the plan validated (ops/cluster/gke_plan.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NIC_LOOP = 'for i in $(seq 0 $((GPU_NICS - 1))); do'
NIC_LOOP_REVERSED = 'for i in $(seq $((GPU_NICS - 1)) -1 0); do'
P = '--project "${PROJECT}"'
R = '--region "${REGION}"'
QUIET = "--quiet"


@dataclass(frozen=True)
class Step:
    """One thing setup does; teardown undoes the steps that have a `delete`, in reverse order."""

    title: str
    create: str
    exists: str | None = None
    """Probe that succeeds when the resource is there: setup skips `create`, teardown runs `delete`."""
    delete: str | None = None
    """None: nothing to undo, or removed with the cluster."""
    delete_if: str | None = None
    """Teardown's probe where `create` needs none (it is idempotent itself); default: `exists`."""
    keep: str | None = None
    """Teardown leaves the resource and says why (a bucket holds the runs and checkpoints)."""
    per_nic: bool = False
    """Repeat for each GPU NIC; `${i}` is the NIC index."""


def cmd(*parts: str) -> str:
    """One command, continued over lines when long, for review."""
    line = " ".join(parts)
    if len(line) <= 100:
        return line
    lines, current = [], parts[0]
    for part in parts[1:]:
        if len(current) + 1 + len(part) > 100:
            lines.append(current)
            current = "    " + part
        else:
            current += " " + part
    return " \\\n".join([*lines, current])


def indent(text: str, prefix: str) -> str:
    # Heredoc bodies must stay at column 0 (an unquoted <<EOF does not strip indentation).
    out, in_heredoc = [], False
    for line in text.split("\n"):
        out.append(line if in_heredoc or not line else prefix + line)
        if line.endswith("<<EOF"):
            in_heredoc = True
        elif line == "EOF":
            in_heredoc = False
    return "\n".join(out)


def used(body: str, variables: dict[str, str]) -> dict[str, str]:
    """The variables a script body uses (and those they refer to), so neither script declares a dead one."""
    def refers(text: str) -> set[str]:
        return {name for name in variables if re.search(rf"\b{name}\b", text)}

    names = refers(body)
    for name in reversed(variables):  # a value only refers to variables declared before it (NET_PREFIX → CLUSTER)
        if name in names:
            names |= refers(variables[name])
    return {k: v for k, v in variables.items() if k in names}


def header(title: str, lines: list[str], variables: dict[str, str]) -> str:
    comment = "".join(f"# {line}\n" if line else "#\n" for line in lines)
    block = "".join(f"{k}={v}\n" for k, v in variables.items())
    return f"#!/usr/bin/env bash\n# {title}\n{comment}set -euo pipefail\n\n# --- tunables\n{block}"


def setup_body(steps: list[Step]) -> str:
    parts = []
    for step in steps:
        body = step.create
        if step.exists:
            body = f"if ! {step.exists} >/dev/null 2>&1; then\n{indent(body, '  ')}\nfi"
        if step.per_nic:
            body = f"{NIC_LOOP}\n{indent(body, '  ')}\ndone"
        parts.append(f"# --- {step.title}\n{body}\n")
    return "\n".join(parts)


def teardown_body(steps: list[Step]) -> str:
    parts = []
    for step in reversed(steps):
        if step.keep is not None:
            parts.append(f"# --- {step.title}: kept\necho \"kept {step.keep}\"\n")
        if step.delete is None:
            continue
        probe = step.delete_if or step.exists
        body = f"if {probe} >/dev/null 2>&1; then\n{indent(step.delete, '  ')}\nfi" if probe else step.delete
        if step.per_nic:
            body = f"{NIC_LOOP_REVERSED}\n{indent(body, '  ')}\ndone"
        parts.append(f"# --- {step.title}\n{body}\n")
    return "\n".join(parts)
