"""Cluster-readiness tasks run by the one worker (`-m shardline.worker --task netcheck|gpucheck`).

Every launcher can run them because they are worker tasks: the same torchrun line, the same spec, only
`--task` differs. Rank 0 prints the human view and writes the JSON result (`--out`, or
`<run dir>/<task>.json` when the run has an id). Exit codes: 0 passed, 1 a check failed,
3 (gpucheck only) no GPU on this machine — the CPU probe still ran and was reported.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from shardline.errors import EXIT_FAILURE, EXIT_OK
from shardline.spec import JobSpec

OPS_TASKS = ("netcheck", "gpucheck")


def result_path(spec: JobSpec, task: str, out: Path | None) -> Path | None:
    if out is not None:
        return out
    if spec.run.id is not None:
        return Path(spec.run.dir) / spec.run.id / f"{task}.json"
    return None


def write_result(path: Path | None, document: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=2))
    os.replace(tmp, path)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def netcheck_tables(records, world: int) -> list[Table]:
    """One nccl-tests style table per op, a row per size × placement."""
    tables = []
    for op in dict.fromkeys(r.op for r in records):
        t = Table(title=f"{op} · {world} ranks · float32", title_justify="left")
        for col in ("size", "count", "placement", "time (us)", "algbw GB/s", "busbw GB/s", "#wrong"):
            t.add_column(col, justify="left" if col == "placement" else "right")
        for r in (r for r in records if r.op == op):
            wrong = f"[red]{r.wrong}[/]" if r.wrong else "0"
            t.add_row(_size(r.bytes), f"{r.count:,}", r.placement, f"{r.time_us:,.1f}", f"{r.algbw_gbps:.3f}",
                      f"{r.busbw_gbps:.3f}", wrong)
        tables.append(t)
    return tables


def run_netcheck(spec: JobSpec, console: Console, out: Path | None) -> int:
    from shardline.ops.checks.netcheck import evaluate, expected_busbw, result_document, sweep
    from shardline.parallel.mesh import distributed

    with distributed() as ctx:
        backend = str(dist.get_backend())
        if ctx.is_main:
            console.print(f"netcheck: {ctx.world} ranks, backend {backend}, device {ctx.device.type}",
                          highlight=False)
        records = sweep(spec, ctx.device)
        verdict = evaluate(records, expected_busbw(spec) if ctx.world > 1 else None)
        if ctx.is_main:
            for table in netcheck_tables(records, ctx.world):
                console.print(table)
            expect = (f"expected ≥ {verdict.expected_busbw_gbps:g} × 0.9 GB/s, measured "
                      f"{verdict.measured_busbw_gbps:.3f}" if verdict.expected_busbw_gbps else "no busbw threshold")
            console.print(f"avg bus bandwidth {verdict.avg_busbw_gbps:.3f} GB/s · #wrong {verdict.wrong} · "
                          f"{expect}", highlight=False)
            if ctx.world == 1:
                console.print("1 rank: every collective is a local copy and crosses no link, so busbw is 0 and no "
                              "bandwidth is judged; the data is still checked (#wrong). Measure links with ≥ 2 ranks.",
                              highlight=False)
            for reason in verdict.reasons:
                console.print(f"[red]FAIL[/] {reason}", highlight=False)
            if verdict.passed:
                console.print("[green]PASS[/]")
            doc = result_document(records, verdict, ctx.world, backend, ctx.device.type)
            write_result(result_path(spec, "netcheck", out), doc)
        dist.barrier()  # every rank leaves once the verdict is told: torchrun ends the others at the first exit
    return EXIT_OK if verdict.passed else EXIT_FAILURE


def gpucheck_table(results) -> Table:
    """One row per rank; NVML columns only when some rank has readings."""
    nvml = any(r.reading for r in results)
    t = Table(title="gpucheck", title_justify="left")
    cols = ["rank", "host", "device", "bf16 TFLOP/s", "% peak", "mem GB/s (% HBM)"]
    cols += ["°C", "W / limit", "PCIe", "NVLink"] if nvml else []
    for col in [*cols, "findings"]:
        t.add_column(col, justify="left" if col in ("host", "device", "findings") else "right")
    for r in results:
        frac = f"{r.peak_fraction:.0%}" if r.peak_fraction is not None else "–"
        mem = f"{r.memory_gbps:.1f}" + (f" ({r.memory_fraction:.0%})" if r.memory_fraction is not None else "")
        row = [str(r.rank), r.host, r.device, f"{r.matmul_tflops:.2f}", frac, mem]
        if nvml:
            g = r.reading or {}
            row += [str(g.get("temperature_c") or "–"),
                    f"{g['power_w']:.0f} / {g['power_limit_w']:.0f}" if g.get("power_limit_w") else "–",
                    f"gen{g['pcie_gen']} x{g['pcie_width']}" if g.get("pcie_width") is not None else "–",
                    f"{g['nvlink_active']}/{g['nvlink_total']}" if g.get("nvlink_total") else "–"]
        row.append("; ".join(f"[{'red' if f['severity'] == 'fail' else 'yellow'}]{f['check']}[/]: {f['detail']}"
                             for f in r.findings) or "ok")
        t.add_row(*row)
    return t


def run_gpucheck(spec: JobSpec, console: Console, out: Path | None) -> int:
    from shardline.ops.checks.gpucheck import check_rank, exit_code, result_document, summarize
    from shardline.parallel.mesh import distributed

    with distributed() as ctx:
        mine = check_rank(spec, ctx.rank, ctx.device)
        gathered: list = [None] * ctx.world
        dist.all_gather_object(gathered, mine)
        summary = summarize(gathered, spec)
        if ctx.is_main:
            console.print(gpucheck_table(gathered))
            if not summary.gpu:
                console.print("[yellow]no GPU[/]: no CUDA device on this machine; the numbers above are the CPU "
                              f"matmul probe and host memory copy bandwidth (exit code {exit_code(summary)})",
                              highlight=False)
            for reason in summary.reasons:
                console.print(f"[red]FAIL[/] {reason}", highlight=False)
            if summary.gpu and summary.passed:
                console.print("[green]PASS[/]")
            write_result(result_path(spec, "gpucheck", out), result_document(gathered, summary))
        dist.barrier()
    return exit_code(summary)


def run_task(spec: JobSpec, task: str, console: Console, out: Path | None) -> int:
    if task == "netcheck":
        return run_netcheck(spec, console, out)
    return run_gpucheck(spec, console, out)


def document_exit_code(doc: dict) -> int:
    """The task's exit code from its JSON result (torchrun turns every worker failure into 1)."""
    if doc.get("kind") == "gpucheck" and not doc.get("gpu"):
        from shardline.ops.checks.gpucheck import EXIT_NO_GPU

        return EXIT_NO_GPU
    return EXIT_OK if doc.get("passed") else EXIT_FAILURE
