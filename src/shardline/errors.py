"""Errors meant for people: each names what is wrong (field or file), the bad value and the fix.

The CLI prints these without a traceback and exits with code 2 (docs/architecture.md §7); anything else is a bug.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_PREEMPTED = 75
EXIT_HANG = 76
"""A rank stopped making progress (resilience/watchdog.py): restart from the last checkpoint, like 1."""
EXIT_INTERRUPTED = 130
"""Ctrl-C before any worker ran (128 + SIGINT, as a shell reports it); once they run, Ctrl-C checkpoints: 75."""
EXIT_IN_PLACE_RESTART = 77
"""The in-place restart agent asks for its container to be restarted in place (engines/kubernetes/inplace_agent.py)."""


class ShardlineError(Exception):
    """Base class for errors caused by user input (spec, data, paths)."""

    def __init__(self, where: str, problem: str, fix: str) -> None:
        self.where = where
        self.problem = problem
        self.fix = fix
        super().__init__(f"{where}: {problem} — {fix}")

    @property
    def field(self) -> str:
        """The spec field or file the error is about (the same as `where`)."""
        return self.where

    def __reduce__(self):  # DCP and torch.distributed carry errors between ranks as pickles
        return (type(self), (self.where, self.problem, self.fix))


class SpecError(ShardlineError):
    """The job spec is invalid; `where` is the dotted field path."""


class DataError(ShardlineError):
    """A data source or prepared-data directory is unusable; `where` is the file or column."""


class ClusterError(ShardlineError):
    """A cluster refused a request or could not be reached; `where` is the request (verb, object, namespace)."""
