"""shardline: train and fine-tune LLMs with PyTorch FSDP2 from one job spec, on any scale.

The public Python API (docs/python-api.md) is importable from here; it loads on first use, so the worker and
the CLI do not pay for what they do not touch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardline import third_party_noise
from shardline.version import __version__

third_party_noise.install()

if TYPE_CHECKING:
    from shardline.api import (
        Attached,
        ClusterError,
        DataError,
        DryRun,
        Plan,
        Rendered,
        Run,
        RunState,
        RunStatus,
        ShardlineError,
        Spec,
        SpecError,
        dry_run,
        launch,
        plan,
        render,
        runs,
        train,
        train_attached,
    )

__all__ = ["Attached", "ClusterError", "DataError", "DryRun", "Plan", "Rendered", "Run", "RunState", "RunStatus",
           "ShardlineError", "Spec", "SpecError", "__version__", "dry_run", "launch", "plan", "render", "runs", "train",
           "train_attached"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        import shardline.api

        return getattr(shardline.api, name)
    raise AttributeError(f"module 'shardline' has no attribute {name!r}")
