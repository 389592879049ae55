"""Local launcher: the one worker command under `torchrun --standalone` on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from shardline.errors import SpecError
from shardline.spec import JobSpec


def worker_command(spec_path: Path, task: str = "train") -> list[str]:
    """The worker invocation shared by every launcher (DESIGN.md §4)."""
    return ["-m", "shardline.worker", "--spec", str(spec_path), "--task", task]


def torchrun_command(spec: JobSpec, spec_path: Path, task: str = "train") -> list[str]:
    if spec.launch.nnodes != 1:
        raise SpecError("launch.nnodes", f"{spec.launch.nnodes} nodes cannot run on this machine alone",
                        "use 1 for local runs, or a cluster launcher for multi-node jobs")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={spec.parallel.nproc_per_node}", f"--max-restarts={spec.launch.max_restarts}",
            *worker_command(spec_path, task)]


def run_local(spec: JobSpec, spec_path: Path, task: str = "train") -> int:
    """Run the worker group to completion; returns torchrun's exit code (the workers', DESIGN.md §5)."""
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return subprocess.run(torchrun_command(spec, spec_path, task), env=env).returncode
