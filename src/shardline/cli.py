"""Command line: parses arguments, calls one function per verb, prints. Exit codes per DESIGN.md §5."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from shardline.errors import EXIT_BAD_INPUT, EXIT_OK, ShardlineError, SpecError
from shardline.resolve import load_spec, preset_names, spec_to_yaml

console = Console(soft_wrap=True)


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", help=f"preset ({', '.join(preset_names())}), spec YAML, or run directory")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec field, e.g. --set train.lr=2e-5 (repeatable)")
    p.add_argument("--nproc", type=int, help="processes on this machine (parallel.nproc_per_node)")


def _resolve(args: argparse.Namespace):
    overrides = list(args.overrides)
    if getattr(args, "nproc", None):
        overrides.append(f"parallel.nproc_per_node={args.nproc}")
    source = args.spec
    if source and Path(source).is_dir():
        run_spec = Path(source) / "spec.yaml"
        if not run_spec.is_file():
            raise SpecError(source, "is a directory without spec.yaml", "give a run directory, preset or YAML")
        source = str(run_spec)
    return load_spec(source, overrides)


def _prepare_with_progress(spec):
    from shardline.data.prepare import prepare

    columns = [TextColumn("preparing {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console, transient=True) as bar:
        tasks: dict[str, int] = {}

        def advance(split: str, n: int) -> None:
            if split not in tasks:
                tasks[split] = bar.add_task(split, total=None)
            bar.advance(tasks[split], n)

        data = prepare(spec, progress=advance)
    table = Table(title=f"prepared data {data.version}", title_justify="left")
    for col in ("split", "examples", "kept", "rows", "tokens", "loss tokens", "fill"):
        table.add_column(col, justify="right")
    for split, s in data.stats["splits"].items():
        fill = f"{100 * s['fill']:.1f}%" if "fill" in s else "–"
        table.add_row(split, *(f"{s.get(k, '–'):,}" if k in s else "–" for k in ("examples", "kept", "rows",
                                                                               "tokens", "loss_tokens")), fill)
    console.print(table)
    dropped = data.stats["dropped"]
    console.print(f"dropped rows: {dropped if dropped else 'none'} · cached at {data.root}", highlight=False)
    return data


def cmd_config_show(args: argparse.Namespace) -> int:
    console.print(spec_to_yaml(_resolve(args)), end="", highlight=False, markup=False)
    return EXIT_OK


def cmd_prepare(args: argparse.Namespace) -> int:
    _prepare_with_progress(_resolve(args))
    return EXIT_OK


def cmd_train(args: argparse.Namespace) -> int:
    from shardline.launch.local import run_local, torchrun_command
    from shardline.rundir import create_run

    spec = _resolve(args)
    if spec.run.id is None and args.spec and Path(args.spec).is_dir():
        spec.run.id = Path(args.spec).name
    torchrun_command(spec, Path("spec.yaml"))  # validates launch settings before anything is written
    spec, run_dir = create_run(spec)
    console.print(f"run [bold]{spec.run.id}[/] → {run_dir}", highlight=False)
    _prepare_with_progress(spec)
    return run_local(spec, run_dir / "spec.yaml", "train")


def cmd_eval(args: argparse.Namespace) -> int:
    from shardline.launch.local import run_local

    run_dir = Path(args.run_dir)
    if not (run_dir / "spec.yaml").is_file():
        raise SpecError(str(run_dir), "is not a run directory (no spec.yaml)", "pass runs/<run_id>")
    overrides = [f"parallel.nproc_per_node={args.nproc}"] if args.nproc else []
    spec = load_spec(str(run_dir / "spec.yaml"), overrides)
    eval_spec = run_dir / "eval-spec.yaml"
    eval_spec.write_text(spec_to_yaml(spec))
    return run_local(spec, eval_spec, "eval")


def cmd_export(args: argparse.Namespace) -> int:
    from shardline.export import export_run

    out = export_run(Path(args.run_dir), Path(args.out), step=args.step, merge_lora=args.merge_lora)
    console.print(f"exported to {out}", highlight=False)
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from shardline.plan import gib, plan_memory, plan_rows, suggest
    from shardline.plan_devices import current_device, get_device

    spec = _resolve(args)
    if args.device or args.memory_gb is not None:
        device = get_device(args.device or current_device().kind, args.memory_gb)
    else:  # this machine's GPU; on a CPU-only host, hub models are planned for an H100
        device = current_device()
        if device.kind == "cpu" and spec.model.path is not None:
            device = get_device("h100")
    plan = plan_memory(spec, device)
    p, t = spec.parallel, spec.train
    ac = p.activation_checkpointing + (f" every {p.activation_checkpointing_every}"
                                       if p.activation_checkpointing_every > 1 else "")
    layout = f"HSDP {p.dp_replicate}×{plan.dp_shard}" if p.dp_replicate > 1 else f"FSDP ×{plan.dp_shard}"
    console.print(
        f"{spec.model.path or 'model.arch'}: {plan.total_params / 1e9:.3g}B params "
        f"({plan.trainable_params / 1e9:.3g}B trainable) · world {spec.world_size} ({layout}"
        f"{', offload' if p.offload else ''}) · micro-batch {t.micro_batch_size} × {t.seq_len} tokens · "
        f"{t.precision} · AC {ac}", highlight=False)
    table = Table(title=f"per-device memory on {plan.device.name} (peak: {plan.phase})", title_justify="left")
    table.add_column("component")
    table.add_column("GiB", justify="right")
    for label, value in plan_rows(plan):
        table.add_row(label, value)
    table.add_row("[bold]total[/]", f"[bold]{gib(plan.total_bytes)}[/]")
    share = f" ({p.nproc_per_node} processes share the host)" if plan.device.kind == "cpu" else ""
    table.add_row(f"capacity{share}", gib(plan.capacity_bytes))
    console.print(table)
    if plan.host_offload_bytes:
        console.print(f"host memory for offloaded state: {gib(plan.host_offload_bytes)} GiB per rank, "
                      f"{gib(plan.host_offload_bytes * (p.nproc_per_node or 1))} GiB per node", highlight=False)
    if plan.fits:
        console.print(f"[green]fits[/]: {gib(plan.capacity_bytes - plan.total_bytes)} GiB to spare", highlight=False)
        return EXIT_OK
    console.print(f"[red]does not fit[/]: {gib(plan.total_bytes - plan.capacity_bytes)} GiB over", highlight=False)
    fix = suggest(spec, device)
    if fix is None:
        console.print("no change tried (AC, micro-batch, layout, offload, up to 8× the GPUs) makes it fit")
    else:
        console.print(f"fits with ({gib(fix.plan.total_bytes)} GiB): {fix.command_line}", highlight=False,
                      markup=False)
        other = suggest(spec, device, offload=False) if "parallel.offload=true" in fix.overrides else None
        if other is not None:
            console.print(f"or, without offload ({gib(other.plan.total_bytes)} GiB): {other.command_line}",
                          highlight=False, markup=False)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardline", description="Train LLMs with FSDP2 from one job spec.")
    verbs = parser.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("train", help="train locally under torchrun (default spec: the tiny preset)")
    _add_spec_args(p)
    p.set_defaults(func=cmd_train)
    p = verbs.add_parser("prepare", help="tokenize, mask and pack the data once (cached)")
    _add_spec_args(p)
    p.set_defaults(func=cmd_prepare)
    p = verbs.add_parser("eval", help="validation loss and SQL execution accuracy of a run's last checkpoint")
    p.add_argument("run_dir")
    p.add_argument("--nproc", type=int)
    p.set_defaults(func=cmd_eval)
    p = verbs.add_parser("export", help="write a Hugging Face model (or LoRA adapter) directory from a checkpoint")
    p.add_argument("run_dir")
    p.add_argument("--out", required=True, help="output directory (must be empty or absent)")
    p.add_argument("--step", type=int, help="committed step to export (default: the latest)")
    p.add_argument("--merge-lora", action="store_true", help="merge LoRA adapters into full weights")
    p.set_defaults(func=cmd_export)
    p = verbs.add_parser("plan", help="per-device memory estimate, whether it fits, and what would make it fit")
    _add_spec_args(p)
    p.add_argument("--device", help="h100, h200, b200, a100, l4 or cpu (default: this machine's device)")
    p.add_argument("--memory-gb", type=float, help="device memory in GiB (overrides the table)")
    p.set_defaults(func=cmd_plan)
    config = verbs.add_parser("config", help="inspect specs").add_subparsers(dest="config_verb", required=True)
    p = config.add_parser("show", help="print the resolved spec")
    _add_spec_args(p)
    p.set_defaults(func=cmd_config_show)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ShardlineError as e:
        console.print(f"[bold red]error:[/] {e.where}: {e.problem}\n  fix: {e.fix}", highlight=False)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
