"""Fault injection for tests and failure drills:
`SHARDLINE_FAULT=<point>[:rank=R][:step=S][:restart=N][:action=stop]`.

At the named point (`train_step`, `validation`, `checkpoint`, `sql_evaluation`, `checkpoint_write` — inside a
save, after this rank's shard files are on disk and before it reports them; `validation_batch`, `generation_batch` —
after each batch of validation or of generation (SQL evaluation, sample generations)) the matching rank raises
`InjectedFault`, exactly as a real error would surface there; with `action=stop` it stops itself (SIGSTOP)
instead, so a drill can kill it at exactly that point; with `action=slow:seconds=X` it sleeps X seconds (a slow
rank, as a throttled GPU or a slow data read makes one; without `step` at every step). `restart=N` limits the
drill to the worker group's Nth start (torchrun's `TORCHELASTIC_RESTART_COUNT`, 0 the first), so a group that
torchrun restarts after the drill killed a rank trains on undisturbed. A stop or a slow-down says
so in the rank's log first, so a drill can tell the rank is there. Unset (always, outside drills), it does nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import time

POINTS = ("train_step", "validation", "checkpoint", "sql_evaluation", "checkpoint_write", "validation_batch",
          "generation_batch")
ACTIONS = ("raise", "stop", "slow")


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
    action = wanted.get("action", "raise")
    if action not in ACTIONS:
        raise ValueError(f"SHARDLINE_FAULT={spec!r}: unknown action {action!r}; choose from {', '.join(ACTIONS)}")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if (name == point and int(wanted.get("rank", rank)) == rank and int(wanted.get("step", step)) == step
            and int(wanted.get("restart", restart)) == restart):
        if action != "raise":
            logging.getLogger("shardline").info("fault injected: %s at %s (rank %d, step %d)",
                                                action, point, rank, step)
        if action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        if action == "slow":
            time.sleep(float(wanted.get("seconds", "1")))
            return
        raise InjectedFault(f"injected fault at {point} (rank {rank}, step {step})")
