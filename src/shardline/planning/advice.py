"""What `shardline plan` says beyond its table: the speed it assumes for a capacity given alone, and each way to
fit with the time that layout would take (`shardline.planning.fixes`, `.offload`, `.cost`)."""

from __future__ import annotations

import torch

from shardline.model.flops import table_peak_tflops
from shardline.planning.cost import devices, estimate_step
from shardline.planning.devices import Device, planned_precision
from shardline.planning.fixes import Suggestion
from shardline.planning.memory import gib, plan_memory
from shardline.planning.offload import offload_cost
from shardline.spec import JobSpec


def assumed_speed(device: Device, precision: str) -> str:
    """`--memory-gb` without `--device`: whose speed the time line assumes, and how to name the card."""
    if device.kind == "cpu":
        return ("--memory-gb without --device: the capacity given, the speed this host's CPU probes at; name a GPU "
                "for its speed (e.g. --device rtx4090)")
    chosen = planned_precision(precision, device)
    peak = table_peak_tflops(device.name, torch.bfloat16 if chosen == "bf16" else torch.float32)
    speed = f" ({peak:g} TFLOP/s dense {chosen})" if peak is not None else ""
    return (f"--memory-gb without --device: the capacity given, the speed of {device.name.split(',')[0]}{speed}, the "
            "spec's own GPU; name the card for its speed (e.g. --device rtx4090)")


def fix_lines(spec: JobSpec, fixes: list[Suggestion], device: Device) -> list[str]:
    """One line per way to fit, in order: what to set, the peak, and that layout's time (offload: its host memory
    and modelled slowdown added)."""
    lines = []
    for i, fix in enumerate(fixes):
        variant = fix.spec or spec
        step_s, _, _ = estimate_step(variant, device.kind, device.name)
        note = ""
        if variant.parallel.offload:
            on_device = variant.model_copy(update={"parallel": variant.parallel.model_copy(update={"offload": False})})
            cost = offload_cost(variant, plan_memory(on_device, device))
            note = f"; {cost.describe(step_s)}"
            step_s += cost.added_s
        hours = variant.train.max_steps * step_s / 3600
        lead = "fits with" if i == 0 else "or, with" if fix.kind in ("QLoRA", "offload") else "or, on"
        lines.append(f"{lead} {fix.kind} ({gib(fix.plan.total_bytes)} GiB): {fix.command_line} · {step_s:.3g} s/step, "
                     f"{hours:.3g} h on {devices(variant.world_size)}{note}")
    return lines
