"""Where a profiled training step's time goes, from the Chrome trace torch.profiler wrote (`observe.profile_steps`;
`bench/protocols.py` keeps it as `protocol-X-trace.json.gz` and writes this breakdown into its result).

    python bench/profile_breakdown.py TRACE[.gz] [--lora-rank R] [--json]

The profiled span runs from the first to the last of the trainer's `shardline.*` labels (torch.profiler's
`ProfilerStep#N` spans for a trace of another program); its steps are counted by `shardline.optimizer` labels
(else `Optimizer.step#…` spans, else `ProfilerStep#N`s). Every microsecond of the span goes to one category:

  attention      scaled-dot-product / flash / efficient / cuDNN / flex attention
  matmul         mm, addmm, bmm, linear, matmul, grouped mm: GEMM kernels (cuBLAS, CUTLASS, nvjet, …)
  lora_matmul    the matmuls among those with the LoRA rank among their operands' last two dims (`lora_rank`)
  optimizer      what runs inside `Optimizer.step#…` (every torch optimizer's step carries that label)
  communication  NCCL kernels, c10d / gloo / NCCL collectives: on a GPU only where no compute kernel runs beside
                 them (communication hidden under compute counts as that compute)
  other          every other op or kernel: elementwise, norms, RoPE, copies, inductor's fused kernels
  host_gaps      GPU trace: no kernel, copy or memset runs on any stream; CPU trace: no op runs (Python, hooks,
                 the trainer's own bookkeeping between ops)

A GPU trace (one with `kernel` events) is classified by device time: each kernel by the host op that launched it
(linked by its correlation id to the launching `cudaLaunchKernel`/`cuLaunchKernel`, whose enclosing ops on its
thread are the chain: an optimizer's step, an attention or matmul op) and else by its name. The device window runs
from the span's start to the last kernel's end (the GPU trails the host). A CPU trace is classified by the main
thread's time: the innermost op's category, where an enclosing optimizer step, collective, attention or matmul op
claims what runs inside it (a matmul op's own `aten::empty` is the matmul's).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

CATEGORIES = ("attention", "matmul", "lora_matmul", "optimizer", "communication", "other", "host_gaps")
LABELS = {"attention": "attention", "matmul": "matmuls", "lora_matmul": "LoRA matmuls", "optimizer": "optimizer",
          "communication": "communication", "other": "other", "host_gaps": "host gaps"}
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
"""Chrome-trace categories of what runs on a GPU stream."""
DEVICE_LABELS = ("gpu_user_annotation", "Trace")
"""The host's labels mirrored on a stream's timeline (`shardline.forward` there too), the profiler's own span."""
CLAIMING = ("optimizer", "communication", "attention", "matmul", "lora_matmul")
"""An op of these categories claims everything that runs inside it."""
ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention", "flex_attention",
                 "fused_attention")
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::linear",
              "aten::matmul", "aten::_addmm_activation", "aten::_grouped_mm", "aten::_scaled_mm",
              "aten::_scaled_grouped_mm", "aten::_int_mm"}
ATTENTION_KERNELS = ("flash", "fmha", "attention", "sdpa", "attn")
MATMUL_KERNELS = ("gemm", "gemv", "cublas", "cutlass", "nvjet", "xmma", "wgmma", "matmul", "sm90_", "sm80_",
                  "sm89_", "sm100_", "ampere_", "hopper_", "splitk")
COMPILED_GRAPH = "## Call CompiledFxGraph"
"""inductor's label around one compiled graph's call: on a CPU its fused C++ kernels run in its own time."""


class TraceError(ValueError):
    """A trace this module cannot read a profiled step from (the message names the file and what is missing)."""


@dataclass(eq=False)
class Event:
    name: str
    cat: str
    ts: float
    end: float
    thread: tuple  # (pid, tid)
    args: dict
    parent: Event | None = None
    children: list[Event] = field(default_factory=list)
    category: str = "host_gaps"


def load(path: Path) -> dict:
    """A Chrome trace, gzipped or not."""
    with open(path, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    with (gzip.open(path, "rt") if gzipped else open(path)) as f:
        return json.load(f)


def _complete_events(trace: dict) -> list[Event]:
    return [Event(e["name"], e.get("cat", ""), float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)),
                  (e.get("pid"), e.get("tid")), e.get("args") or {}) for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and "ts" in e]


def _nest(events: list[Event]) -> list[Event]:
    """Link the events of one thread into their call tree (an event inside another's interval is its child);
    returns the roots."""
    roots: list[Event] = []
    stack: list[Event] = []
    for e in sorted(events, key=lambda e: (e.ts, -(e.end - e.ts))):
        while stack and stack[-1].end <= e.ts:
            stack.pop()
        if stack:
            e.parent = stack[-1]
            stack[-1].children.append(e)
        else:
            roots.append(e)
        stack.append(e)
    return roots


def _operand_dims(event: Event) -> set[int]:
    """The last two dims of each operand of at least two dims (`record_shapes`): a matmul's M, K and N."""
    return {d for dims in event.args.get("Input Dims") or [] if isinstance(dims, list) and len(dims) >= 2
            for d in dims[-2:]}


def _own_category(e: Event, lora_rank: int | None) -> str | None:
    """What an op is by its own name (and a matmul's operands), or None."""
    name = e.name.lower()
    if e.name.startswith("Optimizer.step#"):
        return "optimizer"
    if name.startswith(("c10d::", "nccl:", "gloo:", "record_param_comms")) or "nccl" in name:
        return "communication"
    if e.cat not in ("cpu_op", "user_annotation", "python_function"):
        return None  # a runtime call (cudaLaunchKernel …) is its launching op's
    if any(a in name for a in ATTENTION_OPS):
        return "attention"
    if e.name in MATMUL_OPS:
        return "lora_matmul" if lora_rank and lora_rank in _operand_dims(e) else "matmul"
    return None


def _classify(roots: list[Event], lora_rank: int | None) -> None:
    """Each event's category, top-down: a claiming ancestor's, else its own, else `other` for an op (or anything
    inside one) and `host_gaps` for a label's or the interpreter's own time."""
    todo = [(r, None) for r in roots]
    while todo:
        e, above = todo.pop()
        if above in CLAIMING:
            e.category = above
        elif own := _own_category(e, lora_rank):
            e.category = own
        elif above == "other" or e.cat == "cpu_op" or e.name.startswith(COMPILED_GRAPH):
            e.category = "other"
        else:
            e.category = "host_gaps"
        todo.extend((c, e.category) for c in e.children)


def _span(events: list[Event], source: str) -> tuple[float, float, int, object]:
    """(start, end, steps, main thread) of the profiled steps."""
    labels = [e for e in events if e.name.startswith("shardline.")]
    if labels:
        main = labels[0].thread
        labels = [e for e in labels if e.thread == main]
        steps = (sum(e.name == "shardline.optimizer" for e in labels)
                 or sum(e.name.startswith("Optimizer.step#") for e in events) or 1)
    else:
        labels = [e for e in events if e.name.startswith("ProfilerStep#")]
        if not labels:
            raise TraceError(f"{source}: no profiled step in it (no `shardline.*` label of the trainer, no "
                             "ProfilerStep#): was it written by `observe.profile_steps` or torch.profiler's schedule?")
        main, steps = labels[0].thread, len(labels)
    return min(e.ts for e in labels), max(e.end for e in labels), steps, main


def _cpu_times(roots: list[Event], start: float, end: float) -> dict[str, float]:
    """Microseconds of [start, end] by category on one thread: each event's own time (less its children's)."""
    times = dict.fromkeys(CATEGORIES, 0.0)
    todo = [(r, start, end) for r in roots]
    while todo:
        e, lo, hi = todo.pop()
        a, b = max(e.ts, lo), min(e.end, hi)
        if b <= a:
            continue
        own = b - a
        cursor = a
        for c in e.children:  # siblings in order; an overlap (rounding) is not counted twice
            c_lo, c_hi = max(c.ts, cursor), min(c.end, b)
            if c_hi > c_lo:
                own -= c_hi - c_lo
                todo.append((c, c_lo, c_hi))
                cursor = c_hi
        times[e.category] += own
    times["host_gaps"] += (end - start) - sum(times.values())  # between the top-level events
    return times


def _kernel_category(kernel: Event, launch: Event | None) -> str:
    name = kernel.name.lower()
    if "nccl" in name:
        return "communication"
    if launch is not None and launch.category in CLAIMING:
        return launch.category
    if kernel.cat != "kernel" or (name.startswith("triton_") and not name.startswith("triton_tem_")):
        return "other"  # copies, memsets; inductor's fused kernels (named after every op they fuse)
    if any(a in name for a in ATTENTION_KERNELS):
        return "attention"
    if any(m in name for m in MATMUL_KERNELS) or (name.startswith("triton_tem_") and "mm" in name):
        return "matmul"
    return "other"


def _device_times(kernels: list[tuple[float, float, str]], start: float, end: float) -> dict[str, float]:
    """Microseconds of [start, end] by category on the device: an instant with compute kernels running is split
    evenly among them (communication beside compute is hidden), one with only communication is communication,
    one with nothing running is a host gap."""
    times = dict.fromkeys(CATEGORIES, 0.0)
    edges = sorted({start, end, *(t for k in kernels for t in k[:2] if start < t < end)})
    boundaries = sorted([(max(a, start), 1, i) for i, (a, b, _) in enumerate(kernels) if b > start and a < end]
                        + [(min(b, end), 0, i) for i, (a, b, _) in enumerate(kernels) if b > start and a < end])
    running: dict[int, str] = {}
    j = 0
    for lo, hi in pairwise(edges):
        while j < len(boundaries) and boundaries[j][0] <= lo:
            _, opens, i = boundaries[j]
            if opens:
                running[i] = kernels[i][2]
            else:
                running.pop(i, None)
            j += 1
        compute = [c for c in running.values() if c != "communication"]
        if compute:
            for c in compute:
                times[c] += (hi - lo) / len(compute)
        elif running:
            times["communication"] += hi - lo
        else:
            times["host_gaps"] += hi - lo
    return times


def breakdown(trace: dict, lora_rank: int | None = None, source: str = "trace") -> dict:
    """The profiled steps' time by category (CATEGORIES): ms per step and % of the span, the span per step, the
    step count, and whether device kernels (`device`: "gpu") or the host's ops (`"cpu"`) were classified."""
    events = _complete_events(trace)
    device = [e for e in events if e.cat in DEVICE_CATS]
    host = [e for e in events if e.cat not in (*DEVICE_CATS, *DEVICE_LABELS)]
    start, end, steps, main = _span(host, source)
    threads: dict[object, list[Event]] = {}
    for e in host:
        threads.setdefault(e.thread, []).append(e)
    roots = {thread: _nest(evs) for thread, evs in threads.items()}
    for thread_roots in roots.values():
        _classify(thread_roots, lora_rank)
    if device:
        launches = {e.args["correlation"]: e for e in host if "correlation" in e.args}
        kernels = []
        for k in device:
            launch = launches.get(k.args.get("correlation"))
            if start <= (k.ts if launch is None else launch.ts) <= end:  # launched by the profiled steps
                kernels.append((k.ts, k.end, _kernel_category(k, launch)))
        end = max([end, *(b for _, b, _ in kernels)])
        times = _device_times(kernels, start, end)
    else:
        times = _cpu_times(roots[main], start, end)
    span = end - start
    return {"device": "gpu" if device else "cpu", "steps": steps, "lora_rank": lora_rank,
            "step_ms": round(span / steps / 1e3, 3),
            "categories": {c: {"ms_per_step": round(t / steps / 1e3, 3), "percent": round(100 * t / span, 2)}
                           for c, t in times.items()}}


def breakdown_file(path: Path, lora_rank: int | None = None) -> dict:
    return breakdown(load(path), lora_rank, source=str(path))


def describe(result: dict) -> str:
    """One line for people: the step, then each category's share."""
    parts = " · ".join(f"{LABELS[c]} {v['ms_per_step']:.1f} ms ({v['percent']:.1f} %)"
                       for c, v in result["categories"].items()
                       if v["ms_per_step"] or c in ("optimizer", "host_gaps"))
    where = "device kernels" if result["device"] == "gpu" else "host ops (CPU trace)"
    return f"profile, {result['steps']} step(s) by {where}: {result['step_ms']:.1f} ms a step · {parts}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="a Chrome trace of torch.profiler (.json or .json.gz)")
    parser.add_argument("--lora-rank", type=int, help="tell LoRA's matmuls apart: those with this dim")
    parser.add_argument("--json", action="store_true", help="print the breakdown as JSON")
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        parser.error(f"{args.trace}: no such file (protocols.py keeps OUT/protocol-X-trace.json.gz)")
    try:
        result = breakdown_file(args.trace, args.lora_rank)
    except (TraceError, json.JSONDecodeError, OSError, EOFError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else describe(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
