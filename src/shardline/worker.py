"""The one worker entry point every launcher starts (docs/architecture.md §6):

    torchrun <rendezvous flags> -m shardline.worker --spec <resolved spec.yaml> [--task train|eval|netcheck|gpucheck]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import sys
import time
from pathlib import Path

import torch.distributed as dist
from rich.console import Console

from shardline.clock import Laps
from shardline.data.prepare import PreparedData, prepare, prepared_by_launcher
from shardline.environment import check_environment
from shardline.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PREEMPTED,
    ShardlineError,
    SpecError,
)
from shardline.failures import REPORTER_ENV, WorkerFailure, write_failure
from shardline.observe.session import observing
from shardline.ops.checks.runner import OPS_TASKS, run_task
from shardline.parallel.mesh import DistContext, distributed
from shardline.procfs import process_age
from shardline.resilience.signals import EvaluationStopped, Preempted, StopRequest
from shardline.resilience.watchdog import enable_flight_recorder, hang_watchdog
from shardline.run_status import RECORD_PROCESSES_ENV, record_process
from shardline.rundir import create_run, run_path, update_manifest
from shardline.spec import JobSpec
from shardline.spec.resolve import load_spec
from shardline.spec.rules import require_torch_engine
from shardline.storage import check_locations
from shardline.training.trainer import Trainer


def _setup_logging(run_dir: Path, rank: int) -> None:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / "logs" / f"rank-{rank}.log")
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s"))
    root = logging.getLogger("shardline")
    root.setLevel(logging.INFO)
    root.addHandler(handler)


def prepare_once_per_node(spec: JobSpec, ctx: DistContext) -> PreparedData:
    """Local rank 0 of each node prepares (a file lock dedupes nodes sharing a filesystem); others wait. Under the
    local launcher, which prepared before starting the workers, every rank opens its copy directly."""
    handed = prepared_by_launcher()
    if handed is not None:
        logging.getLogger("shardline.worker").info("data: the launcher's prepared copy %s", handed.root)
        return handed
    if ctx.local_rank == 0:
        prepare(spec)
    dist.barrier()
    return prepare(spec)


def run(spec: JobSpec, task: str, console: Console) -> int:
    startup = Laps()  # the worker's part of the start-up, lap by lap, the trainer's laps after it
    startup.seconds["imports and spec"] = round(process_age() or 0.0, 3)  # from the process's creation
    run_dir = run_path(spec)
    check_locations(spec)  # before the process group and data preparation: a bad location fails in seconds
    stop = StopRequest().install()  # before the process group: a signal during setup is not lost
    if spec.launch.hang_timeout_seconds and task == "train":
        enable_flight_recorder(run_dir)  # read when the process group is created
    with distributed() as ctx:
        startup.lap("process group")
        trainer: Trainer | None = None
        try:
            if ctx.world not in spec.allowed_world_sizes:  # elastic jobs (launch.min_nnodes) allow a range
                raise SpecError("parallel.nproc_per_node", f"the spec expects world size {spec.world_size} "
                                f"but {ctx.world} processes joined", "launch with the spec's nnodes × nproc_per_node")
            if ctx.is_main and not (run_dir / "spec.yaml").exists():
                create_run(spec)  # cluster launches: the run directory lives on storage only the pods can write
            dist.barrier()
            if task == "train" and os.environ.get(RECORD_PROCESSES_ENV):  # a local run: `status` checks they live
                record_process(run_dir, os.getpid(), f"rank {ctx.rank}")
            _setup_logging(run_dir, ctx.rank)
            check_environment(spec, task)  # packages the spec asks for must be on this node (flash-attn, trackers)
            startup.lap("run directory")
            started = time.perf_counter()
            data = prepare_once_per_node(spec, ctx)
            startup.lap("data")
            trainer = Trainer(spec, ctx, data, run_dir, console, stop, prepare_s=time.perf_counter() - started,
                              startup=startup)
            if task == "eval":
                return _evaluate(trainer)
            return _train(trainer, spec, data, run_dir, console)
        except Exception as e:  # noqa: BLE001 - every failure is recorded once, then the process exits
            return _record_failure(e, spec, task, ctx, run_dir, trainer)


def _evaluate(trainer: Trainer) -> int:
    trainer.phase = "evaluation"
    found = trainer.newest_checkpoint()
    if found is None:
        raise ShardlineError(trainer.checkpointer.store.location, "has no intact committed checkpoint",
                             "train the run first")
    store, step = found
    trainer.load_checkpoint(step, with_optimizer=False, store=store)
    try:
        trainer.validate()
        trainer.evaluate_generation()
    except EvaluationStopped:  # a stop signal: abandoned on every rank, nothing written, the run left as it was
        return EXIT_INTERRUPTED
    return EXIT_OK


def _train(trainer: Trainer, spec: JobSpec, data: PreparedData, run_dir: Path, console: Console) -> int:
    ctx = trainer.ctx
    if ctx.is_main:
        update_manifest(run_dir, status="running", dataset_version=data.version, world_size=ctx.world,
                        checkpoint_location=trainer.checkpointer.store.location)
    with observing(spec, run_dir, trainer, console):  # rank 0: cost, /metrics, trackers; the report at the end
        try:
            with hang_watchdog(trainer, run_dir):  # launch.hang_timeout_seconds: name a hung rank, exit 76
                trainer.fit()
        except Preempted:
            if ctx.is_main:
                update_manifest(run_dir, status="preempted", exit_code=EXIT_PREEMPTED, end_time=time.time())
            return EXIT_PREEMPTED
        if ctx.is_main:
            update_manifest(run_dir, status="finished", exit_code=EXIT_OK, end_time=time.time())
    return EXIT_OK


def _record_failure(error: Exception, spec: JobSpec, task: str, ctx: DistContext, run_dir: Path,
                    trainer: Trainer | None) -> int:
    """Traceback to this rank's log, a failure record for the launcher's one message; bad input exits 2."""
    log = run_dir / "logs" / f"rank-{ctx.rank}.log"
    if not logging.getLogger("shardline").handlers:  # failed before logging was set up
        _setup_logging(run_dir, ctx.rank)
    logging.getLogger("shardline").error("failed", exc_info=error)
    committed = location = None
    if trainer is not None:
        try:
            committed = trainer.checkpointer.store.latest()
            location = trainer.checkpointer.store.path(committed) if committed is not None else None
        except Exception:  # noqa: BLE001 - an unreachable store must not hide the original error
            pass
        with contextlib.suppress(Exception):  # the goodput up to the failure; never in the way of the record
            trainer.record_goodput()
    message = f"{error.problem} — {error.fix}" if isinstance(error, ShardlineError) else str(error)
    where = f"{error.where}: " if isinstance(error, ShardlineError) else ""
    phase = trainer.phase if trainer is not None else ("evaluation" if task == "eval" else "setup")
    code = EXIT_BAD_INPUT if isinstance(error, ShardlineError) else EXIT_FAILURE
    write_failure(run_dir, WorkerFailure(
        rank=ctx.rank, host=socket.gethostname(), error_type=type(error).__name__, message=where + message,
        phase=phase, step=trainer.step if trainer is not None else None, max_steps=spec.train.max_steps,
        committed_step=committed, checkpoint=location, log=str(log), time=time.time(), exit_code=code))
    if not os.environ.get(REPORTER_ENV):  # no launcher to tell it: say it here (Ray, a bare worker)
        Console(soft_wrap=True).print(f"[bold red]error:[/] rank {ctx.rank}: {error} (traceback: {log})",
                                      highlight=False)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardline.worker")
    parser.add_argument("--spec", required=True, type=Path, help="resolved spec.yaml of the run")
    parser.add_argument("--task", choices=["train", "eval", *OPS_TASKS], default="train")
    parser.add_argument("--out", type=Path, help="netcheck/gpucheck JSON result (default: <run dir>/<task>.json)")
    args = parser.parse_args(argv)
    console = Console(soft_wrap=True)
    try:
        spec = load_spec(str(args.spec))  # a bad field is a SpecError naming it, not a pydantic traceback
        require_torch_engine(spec, "shardline.worker")
        if args.task in OPS_TASKS:
            return run_task(spec, args.task, console, args.out)
        return run(spec, args.task, console)
    except ShardlineError as e:
        console.print(f"[bold red]error:[/] {e}", highlight=False)
        return EXIT_BAD_INPUT


def exit_without_teardown(code: int) -> None:
    """Flush what the run wrote, then end the process without interpreter finalisation.

    The process group is already destroyed here, but gloo's C++ threads can still hold work objects whose
    tensors reference Python; finalising the interpreter under them aborts the process ("terminate called
    without an active exception", SIGABRT) after a run that finished: seen once in CI at the end of a 2-rank
    `shardline eval`, whose launcher then reported the run as failed. Nothing after `main` needs teardown."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":  # the guard also keeps async checkpoint processes from re-running this
    exit_without_teardown(main())
