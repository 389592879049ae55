"""Command line: parses arguments, calls one function per verb, prints. Exit codes per docs/architecture.md §7."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from shardline.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_OK, EXIT_PREEMPTED, ShardlineError, SpecError
from shardline.spec.resolve import preset_names
from shardline.version import __version__

console = Console(soft_wrap=True)
errors = Console(stderr=True, soft_wrap=True)
"""Errors go to stderr: `shardline config show ... > spec.yaml` never writes an error into the file."""


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", help=f"preset ({', '.join(preset_names())}), spec YAML, or run directory")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec field, e.g. --set train.lr=2e-5 (repeatable)")
    p.add_argument("--nproc", type=int, help="processes on this machine (parallel.nproc_per_node)")


def _resolve(args: argparse.Namespace):
    from shardline.api import Spec

    overrides = list(args.overrides)
    if getattr(args, "nproc", None):
        overrides.append(f"parallel.nproc_per_node={args.nproc}")
    return Spec.load(args.spec, overrides)


def _prepare_with_progress(spec):
    from rich.progress import TimeRemainingColumn

    from shardline.data.prepare import prepare

    columns = [TextColumn("preparing {task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]
    with Progress(*columns, console=console, transient=True) as bar:
        tasks: dict[str, int] = {}
        tokens: dict[str, int] = {}

        def advance(stage: str, n: int, total: int | None, new_tokens: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total, rate="")
                tokens[stage] = 0
            tokens[stage] += new_tokens
            elapsed = bar.tasks[tasks[stage]].elapsed or 0.0
            rate = f"{tokens[stage] / elapsed:,.0f} tokens/s" if tokens[stage] and elapsed > 0 else ""
            bar.update(tasks[stage], advance=n, rate=rate)

        data = prepare(spec, progress=advance)
    table = Table(title=f"prepared data {data.version}", title_justify="left")
    for col in ("split", "examples", "kept", "rows", "tokens", "loss tokens", "fill"):
        table.add_column(col, justify="right")
    for split, s in data.stats["splits"].items():
        fill = f"{100 * s['fill']:.1f}%" if "fill" in s else "–"
        table.add_row(split, *(f"{s.get(k, '–'):,}" if k in s else "–" for k in ("examples", "kept", "rows",
                                                                               "tokens", "loss_tokens")), fill)
    console.print(table)
    sources = data.stats.get("sources") or []
    if len(sources) > 1:
        mix = Table(title="sources", title_justify="left")
        for col in ("source", "format", "weight", "train examples", "repeats", "train tokens", "share"):
            mix.add_column(col, justify="right")
        for src in sources:
            mix.add_row(src["name"], src["format"], f"{src['weight']:g}", f"{src['train_examples']:,}",
                        f"{src['repeats']:g}", f"{src['tokens'].get('train', 0):,}",
                        f"{100 * src['share_of_train_tokens']:.1f}%")
        console.print(mix)
    dropped = data.stats["dropped"]
    console.print(f"format {data.stats.get('format', 'question_answer')} · prompts "
                  f"{data.stats.get('prompt_format', 'plain')} · dropped rows: "
                  f"{dropped if dropped else 'none'} · cached at {data.root}", highlight=False)
    return data


def cmd_config_show(args: argparse.Namespace) -> int:
    console.print(_resolve(args).to_yaml(), end="", highlight=False, markup=False)
    return EXIT_OK


def cmd_prepare(args: argparse.Namespace) -> int:
    from shardline.data.preflight import preflight

    spec = _resolve(args)
    preflight(spec)
    data = _prepare_with_progress(spec)
    count = args.show if args.show is not None else (5 if args.json else 0)
    if count:
        _show_examples(spec, data, count, args.json, quiet=args.show is None)
    return EXIT_OK


def _show_examples(spec, data, count: int, json_file: str | None, quiet: bool) -> None:
    from rich.text import Text

    from shardline.data.preview import LOSS_CLOSE, LOSS_OPEN, marked_text, rendered

    tok = data.tokenizer()
    picked = [(split, ex) for split in ("train", "validation") for ex in data.examples(split)][:count]
    shown = rendered(tok, picked, spec)
    if json_file:
        Path(json_file).write_text(json.dumps(shown, ensure_ascii=False, indent=1))
        console.print(f"wrote {len(shown)} rendered examples to {json_file}", highlight=False)
    if quiet:
        return
    console.print(f"tokens between {LOSS_OPEN} {LOSS_CLOSE} carry loss", highlight=False)
    for i, item in enumerate(shown):
        pair = f" · {item['pair']}" if "pair" in item else ""
        said = (f"dropped, not trained ({item['dropped']}: {item['why']})" if "dropped" in item
                else f"{len(item['tokens'])} tokens, {sum(item['loss'])} with loss")
        line = Text(f"── {i + 1} · {item['split']} · {item['source']}{pair} · {said}\n", style="dim")
        if not item["tokens"]:  # far too long: never tokenized, its text's head
            line.append(item["text"])
        for text, trained in marked_text(tok, item["tokens"], item["loss"]):
            line.append(f"{LOSS_OPEN}{text}{LOSS_CLOSE}" if trained else text, style="green" if trained else None)
        console.print(line)


def cmd_train(args: argparse.Namespace) -> int:
    from shardline.api import train_attached
    from shardline.jsonl import read_jsonl

    ended = train_attached(_resolve(args), prepare=_prepare_with_progress,
                           say=lambda m: console.print(m, highlight=False, markup=False))
    if ended.exit_code == EXIT_PREEMPTED:
        stops = [r for r in read_jsonl(ended.run_dir / "metrics.jsonl") if r.get("event") == "preempted"]
        safe = f"its checkpoint of step {stops[-1]['step']} is committed" if stops else "it has no checkpoint yet"
        console.print(f"stopped: run {ended.run_dir} — {safe}; resume with `shardline train {ended.run_dir}`",
                      highlight=False, markup=False)
    return ended.exit_code


def cmd_eval(args: argparse.Namespace) -> int:
    from shardline.api import Spec
    from shardline.engines.local import run_local
    from shardline.environment import check_environment
    from shardline.rundir import write_run_file

    run_dir = Path(args.run_dir)
    if not (run_dir / "spec.yaml").is_file():
        raise SpecError(str(run_dir), "is not a run directory (no spec.yaml)", "pass runs/<run_id>")
    spec = Spec.load(run_dir, [f"parallel.nproc_per_node={args.nproc}"] if args.nproc else [])
    check_environment(spec, "eval")
    eval_spec = write_run_file(run_dir, "eval-spec.yaml", spec.to_yaml())  # never through a planted link
    return run_local(spec, eval_spec, "eval")


def cmd_export(args: argparse.Namespace) -> int:
    from shardline.api import Run

    out = Run.open(args.run_dir).export(args.out, step=args.step, merge_lora=args.merge_lora, dtype=args.dtype,
                                        say=lambda m: console.print(m, highlight=False, markup=False))
    console.print(f"exported to {out}", highlight=False)
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from shardline.api import Run

    run_dir = Path(args.run_dir)
    if not (run_dir / "spec.yaml").is_file():
        raise SpecError(str(run_dir), "is not a run directory (no spec.yaml)", "pass runs/<run_id>")
    console.print(f"report: {Run.open(run_dir).report()}", highlight=False)
    return EXIT_OK


def cmd_observe_render(args: argparse.Namespace) -> int:
    from shardline.observe.render import render

    for path in render(_resolve(args), Path(args.out)):
        console.print(f"wrote {path}", highlight=False)
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from shardline.api import Spec
    from shardline.api import plan as plan_spec
    from shardline.planning.devices import planned_precision
    from shardline.planning.memory import gib, layout_name, plan_rows
    from shardline.planning.world import planned_world
    from shardline.spec.resolve import source_data

    spec = _resolve(args)
    if not args.dry_run and (args.no_step or args.json or args.world is not None or args.rank):
        raise SpecError("plan", "--rank, --world, --no-step and --json belong to --dry-run", "add --dry-run")
    if args.dry_run:
        from shardline.cli_dry_run import cmd_dry_run

        return cmd_dry_run(args, spec, console)
    if args.device is not None:
        from shardline.planning.devices import get_device

        get_device(args.device)  # an unknown name is refused before anything is planned
    world = planned_world(spec, source_data(args.spec), list(args.overrides), args.nproc, args.device)
    if world.overrides:
        spec = Spec.load(args.spec, [*args.overrides, *world.overrides])
    planned = plan_spec(spec, args.device, args.memory_gb)
    plan, device = planned.memory, planned.device
    console.print(world.line(device.name), highlight=False, markup=False)
    if args.memory_gb is not None and args.device is None:
        from shardline.planning.advice import assumed_speed

        console.print(assumed_speed(device, spec.train.precision), highlight=False, markup=False)
    p, t = spec.parallel, spec.train
    ac = p.activation_checkpointing + (f" every {p.activation_checkpointing_every}"
                                       if p.activation_checkpointing_every > 1 else "")
    layout = layout_name(p.dp_replicate, plan.dp_shard // p.cp, p.tp, p.cp, p.ep)
    console.print(
        f"{spec.model.path or 'model.arch'}: {plan.total_params / 1e9:.3g}B params "
        f"({plan.trainable_params / 1e9:.3g}B trainable) · world {spec.world_size} ({layout}"
        f"{', offload' if p.offload else ''}) · micro-batch {t.micro_batch_size} × {t.seq_len} tokens · "
        f"{planned_precision(t.precision, device)}{f' + float8 {t.float8}' if t.float8 != 'none' else ''} · AC {ac}",
        highlight=False)
    console.print(f"family: {plan.family.name} — {plan.family.adds}", highlight=False)
    if plan.family.experts:
        from shardline.planning.advice import mixture_lines

        for line in mixture_lines(spec, plan, device):
            console.print(line, highlight=False, markup=False)
    table = Table(title=f"per-device memory on {plan.device.name} (peak: {plan.phase})", title_justify="left")
    table.add_column("component")
    table.add_column("GiB", justify="right")
    for label, value in plan_rows(plan):
        table.add_row(label, value)
    table.add_row("[bold]total[/]", f"[bold]{gib(plan.total_bytes)}[/]")
    share = f" ({p.nproc_per_node} processes share the host)" if plan.device.kind == "cpu" else ""
    table.add_row(f"capacity{share}", gib(plan.capacity_bytes))
    console.print(table)
    from shardline.planning.cost import plan_cost_lines

    for line in plan_cost_lines(spec, plan.device.kind, plan.device.name,
                                Path(args.from_run) if args.from_run else None, plan.fits):
        console.print(line, highlight=False, markup=False)
    if plan.host_offload_bytes:
        console.print(f"host memory for offloaded state: {gib(plan.host_offload_bytes)} GiB per rank, "
                      f"{gib(plan.host_offload_bytes * (p.nproc_per_node or 1))} GiB per node", highlight=False)
    if plan.fits:
        console.print(f"[green]fits[/]: {gib(plan.capacity_bytes - plan.total_bytes)} GiB to spare", highlight=False)
        return EXIT_OK
    console.print(f"[red]does not fit[/]: {gib(plan.total_bytes - plan.capacity_bytes)} GiB over", highlight=False)
    if not planned.fixes:
        console.print("no change tried (AC, micro-batch, layout, QLoRA, up to 8× the devices, offload) makes it fit")
    from shardline.planning.advice import fix_lines

    for line in fix_lines(spec, planned.fixes, device):
        console.print(line, highlight=False, markup=False)
    return EXIT_OK


def cmd_cluster_bootstrap(args: argparse.Namespace) -> int:
    from shardline.ops.cluster.bootstrap import BootstrapOptions, local_queue_name, write_bootstrap

    spec = _resolve(args)
    opts = BootstrapOptions(gpus=args.gpus, cpu=args.cpu, memory=args.memory, dws=args.dws, spot=args.spot,
                            priority_classes=args.priority_classes, cluster_queue=args.cluster_queue,
                            bind_launcher=tuple(args.bind_launcher), managed_prometheus=args.managed_prometheus)
    runtime = []
    if args.trainer_runtime:  # engines/ builds it (ops/ may not import engines/); the file keeps one apply order
        from shardline.engines.kubernetes.runtime import training_runtime

        runtime = [training_runtime(spec, args.trainer_runtime)]
    path = write_bootstrap(spec, opts, Path(args.out), runtime)
    console.print(f"wrote {path}; apply with: kubectl apply --server-side -f {path}", highlight=False)
    if spec.launch.kubernetes.queue is None:
        console.print(f"jobs use this queue once the spec says launch.kubernetes.queue: {local_queue_name(spec)}",
                      highlight=False)
    return EXIT_OK


def cmd_cluster_plan_gke(args: argparse.Namespace) -> int:
    from shardline.ops.cluster.gke_plan import GkePlanOptions, write_plan

    if args.profile:
        args.overrides = [*args.overrides, f"launch.profile={args.profile}"]
    opts = GkePlanOptions(project=args.project, zone=args.zone, region=args.region, cluster=args.cluster,
                          max_nodes=args.max_nodes, dws=args.dws, spot=args.spot, build=args.build,
                          repository=args.repository, source=args.source)
    paths = write_plan(_resolve(args), opts, Path(args.out))
    console.print("wrote " + ", ".join(str(p) for p in paths) + "; review, then run setup.sh", highlight=False)
    return EXIT_OK


def _run_ops_task(args: argparse.Namespace, task: str, settings: dict[str, object]) -> int:
    from shardline.engines.local import run_task_locally

    overrides = [f"launch.{task}.{k}={v}" for k, v in settings.items() if v is not None]
    if args.nproc:  # the task trains nothing: keep the batch valid for whatever world size is asked for
        overrides += ["train.micro_batch_size=1", f"train.global_batch_size={args.nproc}"]
    args.overrides = [*overrides, *args.overrides]
    spec = _resolve(args)
    if task == "netcheck":
        from shardline.ops.checks.netcheck import message_sizes

        cfg = spec.launch.netcheck
        message_sizes(cfg.min_bytes, cfg.max_bytes or cfg.min_bytes, cfg.factor)  # bad sizes fail here, not per rank
    return run_task_locally(spec, task, Path(args.json) if args.json else None)


def cmd_netcheck(args: argparse.Namespace) -> int:
    ops = f"[{args.ops}]" if args.ops else None
    return _run_ops_task(args, "netcheck", {
        "min_bytes": args.min_bytes, "max_bytes": args.max_bytes, "factor": args.factor, "iters": args.iters,
        "warmup": args.warmup, "expect_busbw_gbps": args.expect_busbw, "ops": ops})


def cmd_gpucheck(args: argparse.Namespace) -> int:
    return _run_ops_task(args, "gpucheck", {"seconds": args.seconds, "straggler_threshold": args.straggler_threshold,
                                            "min_peak_fraction": args.min_peak_fraction})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardline", description="Train LLMs with FSDP2 from one job spec.")
    parser.add_argument("--version", action="version", version=f"shardline {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("train", help="train locally under torchrun (default spec: the tiny preset)")
    _add_spec_args(p)
    p.set_defaults(func=cmd_train)
    p = verbs.add_parser("prepare", help="tokenize, mask and pack the data once (cached)")
    _add_spec_args(p)
    p.add_argument("--show", type=int, metavar="N", help="print N rendered examples, loss-bearing tokens marked")
    p.add_argument("--json", metavar="FILE", help="write the rendered examples (split, source, text, tokens, loss "
                   "per token) to FILE as a JSON list (N from --show, else 5)")
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
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32", "fp16"), default="auto",
                   help="dtype of the written weights (default auto: the base checkpoint's own, the run's precision "
                   "without model.path; fp32 for a LoRA adapter)")
    p.set_defaults(func=cmd_export)
    p = verbs.add_parser("plan", help="per-device memory estimate, whether it fits, and what would make it fit")
    _add_spec_args(p)
    p.add_argument("--device", help="h100, h200, b200, a100, l4, rtx4090, … (hardware.py) or cpu (default: this "
                   "machine's device); a GPU named is one device unless --nproc or the spec's world is for it")
    p.add_argument("--memory-gb", type=float, help="device memory in GiB (overrides the table; with --device that "
                   "device's speed, alone the speed of the spec's own GPU, which plan names)")
    p.add_argument("--from-run", metavar="RUN_DIR", help="project the cost from this run's measured throughput")
    p.add_argument("--dry-run", action="store_true", help="build the real model at the spec's world size with "
                   "shardline's sharding code (one rank of a fake process group) and simulate one step")
    p.add_argument("--rank", type=int, default=0, help="with --dry-run: the rank to simulate (default 0)")
    p.add_argument("--world", type=int, help="with --dry-run: simulate this world size instead of the spec's")
    p.add_argument("--no-step", action="store_true", help="with --dry-run: the sharding check only (seconds)")
    p.add_argument("--json", metavar="FILE", help="with --dry-run: write its result as JSON")
    p.set_defaults(func=cmd_plan)
    p = verbs.add_parser("report", help="write RUN_DIR/report/: one HTML page with plots, manifest and evaluation")
    p.add_argument("run_dir")
    p.set_defaults(func=cmd_report)
    observe = verbs.add_parser("observe", help="monitoring assets").add_subparsers(dest="observe_verb",
                                                                                   required=True)
    p = observe.add_parser("render", help="write Prometheus alert rules, a Grafana dashboard and a scrape config")
    _add_spec_args(p)
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=cmd_observe_render)
    p = verbs.add_parser("netcheck", help="collective bandwidth sweep (nccl-tests style) with a pass/fail verdict")
    _add_spec_args(p)
    p.add_argument("--json", metavar="FILE", help="write the result (one record per op × size × placement)")
    p.add_argument("--min-bytes", type=int, help="smallest message (default 1 MiB)")
    p.add_argument("--max-bytes", type=int, help="largest message (default 8 GiB on GPU, 64 MiB on CPU)")
    p.add_argument("--factor", type=int, help="size multiplier between steps (default 2)")
    p.add_argument("--iters", type=int, help="timed iterations per size (default 20)")
    p.add_argument("--warmup", type=int, help="untimed iterations per size (default 5)")
    p.add_argument("--ops", help="comma-separated: all_reduce,all_gather,reduce_scatter,all_to_all,broadcast")
    p.add_argument("--expect-busbw", type=float, metavar="GBPS",
                   help="pass threshold: all_gather busbw at the largest size (default: launch.profile's)")
    p.set_defaults(func=cmd_netcheck)
    p = verbs.add_parser("gpucheck", help="GPU health (NVML), bf16 matmul burn-in, memory bandwidth, stragglers")
    _add_spec_args(p)
    p.add_argument("--json", metavar="FILE", help="write the per-rank result")
    p.add_argument("--seconds", type=float, help="duration of each measurement per device (default 5)")
    p.add_argument("--straggler-threshold", type=float, help="flag ranks this fraction below the median (0.1)")
    p.add_argument("--min-peak-fraction", type=float, help="fail a GPU below this fraction of its peak (0.5)")
    p.set_defaults(func=cmd_gpucheck)
    cluster = verbs.add_parser("cluster", help="cluster admin: Kueue/RBAC bootstrap, GKE setup plans")
    cluster = cluster.add_subparsers(dest="cluster_verb", required=True)
    p = cluster.add_parser("bootstrap", help="write Kueue queues, DWS admission check, service account and RBAC")
    _add_spec_args(p)
    p.add_argument("--out", required=True, help="directory for bootstrap.yaml")
    p.add_argument("--gpus", type=int, help="GPU quota per flavor (default: the spec's job)")
    p.add_argument("--cpu", help="CPU quota per flavor, e.g. 448 (default: GPU nodes × the profile's vCPUs)")
    p.add_argument("--memory", help="memory quota per flavor, e.g. 7936Gi (default: GPU nodes × node memory)")
    p.add_argument("--dws", action="store_true", help="DWS flex-start flavor gated by a ProvisioningRequest check")
    p.add_argument("--spot", action="store_true", help="spot-VM flavor (after DWS when both are given)")
    p.add_argument("--priority-classes", action="store_true", help="Kueue shardline-low|medium|high priorities")
    p.add_argument("--cluster-queue", default="shardline", help="ClusterQueue name (default: shardline)")
    p.add_argument("--bind-launcher", action="append", default=[], metavar="SUBJECT",
                   help="bind the shardline-launcher Role: user:NAME, group:NAME, serviceaccount:[NS/]NAME")
    p.add_argument("--managed-prometheus", action="store_true",
                   help="GKE Managed Prometheus PodMonitoring that scrapes rank 0's /metrics")
    p.add_argument("--trainer-runtime", choices=["cluster", "namespaced"],
                   help="also write shardline's Kubeflow Trainer runtime (ClusterTrainingRuntime, or a TrainingRuntime "
                        "in the spec's namespace) that --target trainjob and the Kubeflow SDK run on")
    p.set_defaults(func=cmd_cluster_bootstrap)
    plan = cluster.add_parser("plan", help="reviewable scripts that create a cluster")
    p = plan.add_subparsers(dest="plan_target", required=True).add_parser(
        "gke", help="setup.sh/teardown.sh: VPCs, GKE cluster, DWS + spot GPU pools, Kueue, JobSet, NCCL installer")
    _add_spec_args(p)
    p.add_argument("--out", required=True, help="directory for setup.sh, teardown.sh and bootstrap.yaml")
    p.add_argument("--project", required=True, help="GCP project id")
    p.add_argument("--zone", required=True, help="zone of the GPU nodes, e.g. us-central1-b")
    p.add_argument("--region", help="region of the cluster (default: the zone's region)")
    p.add_argument("--cluster", default="shardline", help="GKE cluster name (default: shardline)")
    p.add_argument("--profile", help="machine profile a3-high|a3-mega|a3-ultra|a4 (default: launch.profile)")
    p.add_argument("--max-nodes", type=int, help="most GPU nodes per pool (default: launch.nnodes)")
    p.add_argument("--dws", action=argparse.BooleanOptionalAction, default=True, help="DWS flex-start pool")
    p.add_argument("--spot", action=argparse.BooleanOptionalAction, default=True, help="spot-VM pool")
    p.add_argument("--build", action=argparse.BooleanOptionalAction, default=True,
                   help="Artifact Registry repository + Cloud Build of the image; setup.sh writes image.txt")
    p.add_argument("--repository", default="shardline", help="Artifact Registry repository (default: shardline)")
    p.add_argument("--source", default=".", help="the checkout Cloud Build uploads, as setup.sh sees it (default: .)")
    p.set_defaults(func=cmd_cluster_plan_gke)
    from shardline.cli_launch import add_launch_verbs

    add_launch_verbs(verbs, _add_spec_args, _resolve, console)
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
        errors.print(f"[bold red]error:[/] {e.where}: {e.problem}\n  fix: {e.fix}", highlight=False)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # before any worker ran (data preparation): the run, if any, is marked failed
        errors.print("interrupted: nothing was trained in this attempt", highlight=False)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
