"""Local launcher: the one worker command under `torchrun --standalone` on this machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from shardline.errors import EXIT_OK, EXIT_PREEMPTED, SpecError
from shardline.launch.command import torchrun_policy_flags, worker_command
from shardline.rundir import read_manifest
from shardline.spec import JobSpec


def torchrun_command(spec: JobSpec, spec_path: Path, task: str = "train") -> list[str]:
    if spec.launch.nnodes != 1:
        raise SpecError("launch.nnodes", f"{spec.launch.nnodes} nodes cannot run on this machine alone",
                        "use 1 for local runs, or a cluster launcher for multi-node jobs")
    return [sys.executable, "-m", "shardline.launch.torchrun", "--standalone",
            f"--nproc-per-node={spec.parallel.nproc_per_node}", *torchrun_policy_flags(spec),
            *worker_command(spec_path, task)]


def run_local(spec: JobSpec, spec_path: Path, task: str = "train") -> int:
    """Run the worker group to completion and return the exit code (DESIGN.md §5).

    SIGTERM/SIGUSR1 sent to this process are passed to torchrun, which forwards them to the workers
    and gives them `launch.grace_seconds` to checkpoint; a run that stopped that way exits 75.
    """
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    proc = subprocess.Popen(torchrun_command(spec, spec_path, task), env=env)

    def forward(signum, frame):
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code != EXIT_OK and read_manifest(spec_path.parent).get("status") == "preempted":
        return EXIT_PREEMPTED
    return code
