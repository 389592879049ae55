"""Local launcher: the one worker command under `torchrun --standalone` on this machine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from shardline.errors import EXIT_FAILURE, EXIT_OK, EXIT_PREEMPTED, SpecError
from shardline.launch.command import torchrun_policy_flags, worker_command
from shardline.ops.tasks import document_exit_code, run_gpucheck
from shardline.rundir import read_manifest
from shardline.spec import JobSpec
from shardline.spec.resolve import spec_to_yaml


def torchrun_command(spec: JobSpec, spec_path: Path, task: str = "train") -> list[str]:
    if spec.launch.nnodes != 1:
        raise SpecError("launch.nnodes", f"{spec.launch.nnodes} nodes cannot run on this machine alone",
                        "use 1 for local runs, or a cluster launcher for multi-node jobs")
    return [sys.executable, "-m", "shardline.launch.torchrun", "--standalone",
            f"--nproc-per-node={spec.parallel.nproc_per_node}", *torchrun_policy_flags(spec),
            *worker_command(spec_path, task)]


def run_local(spec: JobSpec, spec_path: Path, task: str = "train") -> int:
    """Run the worker group to completion and return the exit code (docs/architecture.md §7).

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


def run_task_locally(spec: JobSpec, task: str, out: Path | None) -> int:
    """The task under `torchrun --standalone` on this machine (the local launcher's command + `--out`).

    gpucheck on a machine without CUDA runs in this process instead: there is no GPU to check per rank,
    only the CPU probe to report, and exit code 3 says so without torchrun's failure report around it.
    """
    import torch

    with tempfile.TemporaryDirectory(prefix=f"shardline-{task}-") as tmp:
        result = Path(tmp) / f"{task}.json"
        if task == "gpucheck" and not torch.cuda.is_available():
            env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(_free_port())}
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                code = run_gpucheck(spec, Console(soft_wrap=True), result)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        else:
            spec_path = Path(tmp) / "spec.yaml"
            spec_path.write_text(spec_to_yaml(spec))
            env = dict(os.environ)
            env.setdefault("TOKENIZERS_PARALLELISM", "false")
            code = subprocess.run([*torchrun_command(spec, spec_path, task), "--out", str(result)], env=env).returncode
        if not result.is_file():
            return code or EXIT_FAILURE
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(result, out)
        return document_exit_code(json.loads(result.read_text()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
