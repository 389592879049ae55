"""`shardline plan SPEC --dry-run`: the real sharding code, and one simulated step, beside the plan (printing only)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from shardline.api import DryRun, dry_run
from shardline.errors import EXIT_OK, SpecError
from shardline.planning.memory import gib, layout_name, model_shape
from shardline.spec import JobSpec

UNSEEN = ("not seen by the simulation: CUDA context and workspaces, NCCL buffers, allocator fragmentation, "
          "GPU kernels (flash attention, fused AdamW: it runs the CPU kernels named above)")


def _pct(planned: float | None, simulated: float) -> str:
    return "" if planned is None or not simulated else f"{100 * (planned / simulated - 1):+.1f} %"


def print_dry_run(run: DryRun, console: Console) -> None:
    r = run.result
    layout = layout_name(r["dp_replicate"], r["dp_shard"], r.get("tp", 1), ep=r.get("ep", 1))
    console.print(f"dry run: rank {r['rank']} of world {r['world']} ({layout}, {r['precision']}), torch {r['torch']}, "
                  f"sharded in {r['sharding_seconds']:.1f} s" + (f", step simulated in {r['step_seconds']:.0f} s"
                                                                   if "step" in r else ""), highlight=False)
    device = r["planned"]["device"]
    table = Table(title="per-rank memory, GiB (gather buffers: root + 2 blocks; plan (CPU): for the kernels simulated)",
                  title_justify="left")
    for col in ("", "simulated", "plan (CPU)", "diff", f"plan ({device})", "diff"):
        table.add_column(col, justify="left" if not col else "right")
    for label, sim, same, dev in run.rows():
        table.add_row(label, gib(sim), gib(same), _pct(same, sim), gib(dev), _pct(dev, sim))
    console.print(table)
    sharding = r["sharding"]
    console.print(f"{sharding['groups']} FSDP groups; padding {gib(sharding['padding'])} GiB of the parameter shards",
                  highlight=False)
    if "float8_linears" in r:
        console.print(f"float8: {r['float8_linears']} block linears run as torchao's Float8Linear (train.float8)",
                      highlight=False)
    if "routing" in r:
        console.print(f"expert parallel simulated with {r['routing']}", highlight=False)
    for note in sharding["notes"]:
        console.print(f"  · {note}", highlight=False, markup=False)
    step = r.get("step")
    if step is not None:
        console.print(f"simulated peak in {step['phase']}; planned peak at {r['planned_cpu_kernels']['phase']} "
                      f"({r['kernels']})", highlight=False)
        expected = step["flops_expected"]
        console.print(f"FLOPs of this rank's step: {step['flops']:.4g} counted (no SDPA: the CPU kernel is not "
                      f"counted), {expected:.4g} by model/flops.py ({_pct(expected, step['flops'])})", highlight=False)
    sampling = r.get("sampling")
    if sampling is not None:
        console.print(f"GRPO sampling simulated at its last decoded token: {sampling['sequences']} sequences per rank, "
                      f"a KV cache of {sampling['tokens']} positions", highlight=False)
    console.print(f"{UNSEEN}; the plan adds {gib(r['planned']['unseen'])} GiB for runtime, allocator and "
                  "steady-state caches", highlight=False)


def cmd_dry_run(args: argparse.Namespace, spec: JobSpec, console: Console) -> int:
    def progress(line: str) -> None:
        console.print(f"[dim]… {line}[/]", highlight=False)

    run = dry_run(spec, rank=args.rank, world=args.world, step=not args.no_step, device=args.device,
                  memory_gb=args.memory_gb, progress=progress)
    print_dry_run(run, console)
    if args.json:
        Path(args.json).write_text(json.dumps(run.result, indent=2) + "\n")
        console.print(f"wrote {args.json}", highlight=False)
    return EXIT_OK


def cannot_judge(spec: JobSpec) -> str | None:
    """What keeps the dry run from judging `spec` on this machine, or None. Neither is a fault of the spec: a
    context-parallel group is not simulated, and a model whose config.json is only where the job runs (a path in
    the pod, a hub model the planner does not know offline) cannot be built here."""
    if spec.parallel.cp > 1:  # planning/simulation/dry_run.py refuses it: its step would count whole rows per rank
        return f"parallel.cp={spec.parallel.cp}: the dry run does not simulate a context-parallel group"
    path = spec.model.path
    if path is None or (Path(path).expanduser() / "config.json").is_file():
        return None  # a readable config.json is judged: a broken one is the spec's error
    try:
        model_shape(spec.model)  # a hub model the planner knows offline, or one in the Hugging Face cache
    except SpecError:  # without a config.json here, its one error: neither known offline nor cached
        return (f"model.path {path!r}: no config.json on this machine and not a hub model the planner knows "
                "offline, so the model is built only where the job runs")
    return None


def sharding_check(spec: JobSpec) -> str:
    """`plan --dry-run --no-step` as one line for `launch` and `render`; raises what the check finds. A spec it
    cannot judge here (`cannot_judge`) passes with a line that says what went unchecked and why."""
    if spec.train.engine != "torch":
        return f"sharding check: does not apply ({spec.train.engine} trains with its own code)"
    unchecked = cannot_judge(spec)
    if unchecked is not None:
        return f"sharding check not run (it cannot judge this spec here): {unchecked}"
    r = dry_run(spec, step=False).result
    s = r["sharding"]
    notes = f"; {len(s['notes'])} parameters leave ranks with only padding" if s["notes"] else ""
    return (f"sharding check passed: world {r['world']}, {s['groups']} FSDP groups, "
            f"{gib(s['params'] + s['grads'] + s['optimizer'])} GiB of sharded state per rank{notes} "
            f"({r['sharding_seconds']:.1f} s)")
