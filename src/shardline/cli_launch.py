"""Cluster verbs: render, launch, status, logs, wait, cancel — the same for every target (engines/backend.py)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from shardline.api import Run, RunState, launch, render
from shardline.api import runs as list_runs
from shardline.cli_dry_run import sharding_check
from shardline.clock import format_duration
from shardline.engines.backend import EXIT_BY_PHASE, EXIT_TIMEOUT, record_path
from shardline.engines.registry import BACKENDS
from shardline.errors import EXIT_OK, ShardlineError

TASKS = ("train", "eval", "netcheck", "gpucheck")


def _checks_sharding(args: argparse.Namespace) -> bool:
    """Cluster targets, tasks that build the model: the sharding check of `plan --dry-run --no-step` first."""
    return not args.skip_dry_run and args.target != "local" and args.task in ("train", "eval")


def cmd_render(args: argparse.Namespace, resolve: Callable, console: Console) -> int:
    spec = resolve(args)
    rendered = render(spec, args.target, args.task, args.out)
    if args.out is None:
        for text in rendered.files.values():
            console.print(text, end="", highlight=False, markup=False)
    for path in rendered.written:
        console.print(f"wrote {path}", highlight=False)
    if _checks_sharding(args):
        try:  # on stderr: the rendered files on stdout stay valid YAML/JSON
            note = sharding_check(spec)
        except ShardlineError as e:
            note = f"sharding check FAILED (launch will refuse it): {e}"
        Console(stderr=True, soft_wrap=True).print(note, highlight=False, markup=False)
    return EXIT_OK


def cmd_launch(args: argparse.Namespace, resolve: Callable, console: Console) -> int:
    spec = resolve(args)
    if _checks_sharding(args) and not args.dry_run:
        try:
            console.print(sharding_check(spec), highlight=False, markup=False)
        except ShardlineError as e:
            raise ShardlineError(e.where, e.problem, f"{e.fix} (or launch anyway with --skip-dry-run)") from e
    if args.dry_run:
        for name, text in render(spec, args.target, args.task).files.items():
            console.print(f"# {name}", highlight=False, markup=False)
            console.print(text, end="", highlight=False, markup=False)
        return EXIT_OK
    run = launch(spec, args.target, args.task)
    record = run.record
    console.print(f"launched [bold]{record.run_id}[/] on {args.target}"
                  + (f" (namespace {record.namespace})" if record.namespace else "")
                  + (f" job {record.job_id}" if record.job_id else ""), highlight=False)
    console.print(f"record: {record_path(Path(spec.run.dir) / record.run_id)}\n"
                  f"next: shardline status {record.run_id} · shardline logs {record.run_id} --follow"
                  f" · shardline wait {record.run_id}", highlight=False)
    return EXIT_OK


def print_state(state: RunState, console: Console, title: str) -> None:
    console.print(f"[bold]{title}[/]: {state.phase}" + (f" · {state.restarts} gang restarts" if state.restarts
                                                         else ""), highlight=False)
    for reason in state.reasons:
        console.print(f"  · {reason}", highlight=False, markup=False)
    if state.run is not None and state.run.liveness is not None:
        console.print(f"  · {state.run.liveness}", highlight=False, markup=False)
    if state.run is not None and state.run.goodput is not None:
        console.print(f"  · {state.run.goodput.line()}", highlight=False, markup=False)
    if state.ranks:
        table = Table(title_justify="left")
        for col in ("rank", "pod / host", "state", "restarts", "detail"):
            table.add_column(col)
        for r in state.ranks:
            table.add_row(str(r.rank), r.name, r.state, str(r.restarts), r.detail)
        console.print(table)


def cmd_status(args: argparse.Namespace, console: Console) -> int:
    run = Run.open(args.run, args.runs_dir)
    print_state(run.status(), console, f"{run.id} ({run.target})")
    return EXIT_OK


def cmd_logs(args: argparse.Namespace, console: Console) -> int:
    for line in Run.open(args.run, args.runs_dir).logs(args.rank, args.follow):
        console.print(line, highlight=False, markup=False)
    return EXIT_OK


def cmd_wait(args: argparse.Namespace, console: Console) -> int:
    run = Run.open(args.run, args.runs_dir)
    try:
        final = run.wait(args.timeout, args.poll, on_change=lambda s: print_state(s, console, run.id))
    except TimeoutError:
        console.print(f"timed out after {args.timeout} s", highlight=False)
        return EXIT_TIMEOUT
    code = EXIT_BY_PHASE[final.phase]
    console.print({0: "succeeded", 1: "failed", 75: "preempted (a checkpoint was saved; train the run again to "
                   "resume)"}[code], highlight=False)
    return code


def cmd_cancel(args: argparse.Namespace, console: Console) -> int:
    run = Run.open(args.run, args.runs_dir)
    run.cancel()
    console.print(f"cancelled {run.id}", highlight=False)
    return EXIT_OK


def cmd_runs(args: argparse.Namespace, console: Console) -> int:
    runs = list_runs(args.directory)
    if args.json:
        console.print_json(json.dumps([r.model_dump(mode="json") for r in runs]))
        return EXIT_OK
    table = Table(title=f"runs in {args.directory}", title_justify="left")
    for col in ("run", "target", "status", "step", "loss", "val loss", "tok/s/dev", "MFU", "cost", "started",
                "duration"):
        table.add_column(col, justify="left" if col in ("run", "target", "status", "started") else "right")

    def num(v, fmt: str) -> str:
        return "–" if v is None else format(v, fmt)

    for r in runs:
        table.add_row(r.run_id, r.target, r.outcome,  # the word `status` prints
                      f"{r.step}/{r.max_steps}" if r.step is not None else f"–/{r.max_steps or '–'}",
                      num(r.last_loss, ".4f"), num(r.val_loss, ".4f"), num(r.tokens_per_s_per_device, ",.0f"),
                      "–" if r.mfu is None else f"{100 * r.mfu:.1f}%",
                      "–" if r.cost_usd is None else f"${r.cost_usd:.4g}",
                      (r.started or "–").replace("+00:00", "Z"),
                      "–" if r.elapsed_s is None else format_duration(r.elapsed_s))
    wide = console if console.is_terminal else Console(soft_wrap=True, width=250)  # piped: never cut an id
    wide.print(table if runs else f"no runs in {args.directory}", highlight=False)
    return EXIT_OK


def add_launch_verbs(verbs, add_spec_args: Callable, resolve: Callable, console: Console) -> None:
    targets = sorted(BACKENDS)
    for verb, helptext in (("render", "write the engine's manifests / batch script for a spec (nothing is applied)"),
                           ("launch", "submit the job to its engine and record where it runs")):
        p = verbs.add_parser(verb, help=helptext)
        add_spec_args(p)
        p.add_argument("--target", required=True, choices=targets)
        p.add_argument("--task", choices=TASKS, default="train", help="what the worker runs (default train)")
        p.add_argument("--skip-dry-run", action="store_true", help="cluster targets: skip the sharding check "
                       "(`plan --dry-run --no-step`) that runs first" + (" and refuses a spec that fails it"
                                                                      if verb == "launch" else ""))
        if verb == "render":
            p.add_argument("--out", help="directory for the files (default: print)")
            p.set_defaults(func=lambda a: cmd_render(a, resolve, console))
        else:
            p.add_argument("--dry-run", action="store_true", help="print every object that would be applied")
            p.set_defaults(func=lambda a: cmd_launch(a, resolve, console))

    def run_parser(verb: str, helptext: str, func: Callable):
        p = verbs.add_parser(verb, help=helptext)
        p.add_argument("run", help="run directory or run id printed by `launch`")
        p.add_argument("--runs-dir", default="runs", help="where run ids are looked up (default runs)")
        p.set_defaults(func=lambda a: func(a, console))
        return p

    run_parser("status", "where a run is: phase, progress and ETA, why it waits, each rank's pod/host", cmd_status)
    p = run_parser("logs", "print a launched run's logs, lines prefixed with the rank", cmd_logs)
    p.add_argument("--rank", type=int, help="one rank only (default: all)")
    p.add_argument("--follow", "-f", action="store_true", help="wait for the job to start, then stream")
    p = run_parser("wait", "block until the run ends: exit 0 succeeded, 1 failed, 124 timed out", cmd_wait)
    p.add_argument("--timeout", type=float, help="seconds (default: no limit)")
    p.add_argument("--poll", type=float, default=10.0, help="seconds between status checks")
    run_parser("cancel", "delete the run's objects / cancel its job (local: SIGTERM, the run checkpoints, exit 75)",
               cmd_cancel)
    p = verbs.add_parser("runs", help="one table of the runs in a directory, newest first")
    p.add_argument("directory", nargs="?", default="runs", help="default runs")
    p.add_argument("--json", action="store_true", help="the same rows as JSON, for scripts")
    p.set_defaults(func=lambda a: cmd_runs(a, console))
