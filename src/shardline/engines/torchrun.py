"""`python -m shardline.engines.torchrun <torchrun arguments>`: torchrun, with failures told once.

The same agent (`torch.distributed.run`): rendezvous, restarts, signal forwarding and exit are unchanged. What
differs when workers fail: instead of torchrun's `ChildFailedError` traceback and per-rank dump, it prints one
message built from the workers' failure records (rank, phase, exception, traceback file, last safe checkpoint),
marks the run failed in its manifest, and exits with the first failed worker's own exit code (torchrun exits 1
whatever the worker said), so 2 (bad input) and 75 (preempted) reach the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, parse_args, run

from shardline.errors import EXIT_FAILURE, EXIT_HANG, EXIT_OK, EXIT_PREEMPTED
from shardline.failures import HANG_ERROR, PEER_LOST, REPORTER_ENV, WorkerFailure, failure_message, read_failures

CPU_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 30),
                  "MALLOC_TOP_PAD_": str(512 << 20)}
"""glibc malloc settings for CPU training workers (torch's CPU allocator is plain malloc): freed heap blocks stay
(no trimming), so small and medium tensors are not page-faulted in again every step; blocks from 1 MiB up are
mmapped and returned on free. A fixed threshold also stops glibc raising it to the largest freed block.
The threshold was 32 MiB (+7 % tok/s on the bench model, bench/RESULTS.md), but the heap then fragments under
per-step sizes that vary (document-length buckets, the last loss chunk): the default tiny run's peak RSS grew
0.59 → 1.11 GiB over 60 steps. At 1 MiB the heap still grows slowly (1.41 GiB by step 900), which the workers'
`training.heap` trim (every 50 steps) holds at ~1.0 GiB. Workers on a GPU host keep glibc's defaults (their
tensors live in the CUDA caching allocator). Values the environment already sets win."""


def worker_allocator_env(on_gpu: bool) -> dict[str, str]:
    """What the workers' environment gets (before they start): CPU_MALLOC_ENV on CPU hosts, less what is set."""
    return {} if on_gpu else {k: v for k, v in CPU_MALLOC_ENV.items() if k not in os.environ}


def _run_dir(worker_args: list[str]) -> Path | None:
    """The run directory of the worker command's `--spec`, when the spec names one."""
    if "--spec" not in worker_args:
        return None
    from shardline.errors import ShardlineError
    from shardline.rundir import read_spec, run_path

    try:
        return run_path(read_spec(Path(worker_args[worker_args.index("--spec") + 1])))
    except (ShardlineError, OSError, ValueError, IndexError):
        return None


def exit_code(error: ChildFailedError, failures: list[WorkerFailure] | None = None) -> int:
    """The exit code of the worker whose failure caused the others' (the first recorded cause, not a rank that
    only lost its peer and may have aborted first), else of the first failed worker; a worker killed by a
    signal gives 128 + signal, as a shell does."""
    if any(f.error_type == HANG_ERROR for f in failures or []):
        return EXIT_HANG  # the named rank was frozen and killed; the hang is the cause, whoever reported it
    causes = [f for f in failures or [] if not PEER_LOST.search(f.message) and f.rank in error.failures]
    if causes and causes[0].exit_code is not None:  # the code the cause meant, even if torchrun SIGTERMed it first
        return causes[0].exit_code
    first = error.failures[causes[0].rank] if causes else error.get_first_failure()[1]
    return first.exitcode if first.exitcode > 0 else 128 - first.exitcode if first.exitcode < 0 else EXIT_FAILURE


def _status(run_dir: Path) -> str | None:
    from shardline.rundir import read_manifest

    try:
        return read_manifest(run_dir).get("status")
    except (OSError, ValueError):
        return None


def _task(worker_args: list[str]) -> str:
    """The worker command's `--task` (train when absent)."""
    return worker_args[worker_args.index("--task") + 1] if "--task" in worker_args[:-1] else "train"


def told_verdict(error: ChildFailedError, worker_args: list[str], run_dir: Path | None, task: str,
                 started: float) -> int | None:
    """The exit code of a readiness task whose ranks all exited with the code of the verdict they wrote
    (netcheck FAIL, gpucheck without a GPU): they told it already, so there is no failure to report."""
    from shardline.ops.checks.runner import OPS_TASKS, document_exit_code

    if task not in OPS_TASKS:
        return None
    out = worker_args[worker_args.index("--out") + 1] if "--out" in worker_args[:-1] else None
    path = Path(out) if out else run_dir / f"{task}.json" if run_dir is not None else None
    try:
        if path is None or path.stat().st_mtime < started:
            return None
        code = document_exit_code(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None
    return code if all(f.exitcode == code for f in error.failures.values()) else None


def report(error: ChildFailedError, run_dir: Path | None, started: float, task: str = "train") -> str:
    """The one failure message, and, for training, the run marked failed (unless it stopped on purpose:
    preemption). Another task (`shardline eval RUN`) never changes the training run's status or end time."""
    failures = read_failures(run_dir, since=started) if run_dir else []
    recorded = {f.rank for f in failures}
    unexplained = {rank: f.exitcode for rank, f in error.failures.items()
                   if rank not in recorded and not (failures and f.exitcode in (-signal.SIGTERM, EXIT_HANG))}
    message = failure_message(failures, unexplained)
    code = exit_code(error, failures)
    if task == "train" and run_dir is not None and (run_dir / "manifest.json").exists() and code != EXIT_PREEMPTED:
        from shardline.rundir import update_manifest

        first = failures[0] if failures else None
        update_manifest(run_dir, status="failed", exit_code=code, end_time=time.time(),
                        failure={"message": message, "rank": first.rank if first else min(error.failures),
                                 "phase": first.phase if first else None,
                                 "error_type": first.error_type if first else None,
                                 "committed_step": first.committed_step if first else None})
    return message


def _write_report(run_dir: Path) -> None:
    """The report of a failed run, written once the failure is in the manifest (rank 0 leaves it to here)."""
    from shardline.errors import ShardlineError
    from shardline.observe.report import write_report_safely
    from shardline.rundir import read_spec

    try:
        if not read_spec(run_dir / "spec.yaml").observe.report:
            return
    except (ShardlineError, OSError, ValueError):
        return
    write_report_safely(run_dir, lambda m: print(m, file=sys.stderr))


NEWER_FLAGS = ("--shutdown-timeout",)
"""torchrun flags shardline's command lines use that an older torch's torchrun lacks (2.11 has no
--shutdown-timeout: it then waits its own default before SIGKILL)."""


def known_flags(argv: list[str], parser: argparse.ArgumentParser | None = None) -> list[str]:
    """`argv` without the NEWER_FLAGS this torchrun does not know (each dropped one is said on stderr)."""
    known = (parser or get_args_parser())._option_string_actions
    kept = []
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in NEWER_FLAGS and flag not in known:
            print(f"warning: this torch's torchrun has no {flag}; using its default", file=sys.stderr)
            continue
        kept.append(arg)
    return kept


def main(argv: list[str] | None = None) -> int:
    args = parse_args(known_flags(sys.argv[1:] if argv is None else argv))
    os.environ[REPORTER_ENV] = "1"  # workers leave the telling to this process
    import torch

    os.environ.update(worker_allocator_env(torch.cuda.is_available()))  # read by each worker's libc at start
    started = time.time()
    try:
        run(args)
    except SignalException as e:  # the workers had the signal too; a preempted run already said what it saved
        worker_args = list(args.training_script_args)
        run_dir = _run_dir(worker_args)
        status = _status(run_dir) if run_dir is not None else None
        if status == "finished" and _task(worker_args) == "train":
            return EXIT_OK  # the signal came after the workers recorded the end of the run: nothing was cut short
        return EXIT_PREEMPTED if status == "preempted" else 128 + int(e.sigval)
    except ChildFailedError as e:
        worker_args = list(args.training_script_args)
        run_dir, task = _run_dir(worker_args), _task(worker_args)
        told = told_verdict(e, worker_args, run_dir, task, started)
        if told is not None:
            return told
        code = exit_code(e, read_failures(run_dir, since=started) if run_dir else [])
        if code != EXIT_PREEMPTED:  # a preempted worker already said what it saved
            print(f"error: {report(e, run_dir, started, task)}", file=sys.stderr)
            if run_dir is not None and args.node_rank == 0 and task == "train":
                _write_report(run_dir)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
