"""What `shardline plan` says beyond its table: the speed it assumes for a capacity given alone, a mixture of experts'
active parameters, expert shards and headroom for unbalanced routing, and each way to fit with the time that layout
would take (`shardline.planning.fixes`, `.offload`, `.cost`)."""

from __future__ import annotations

import math

import torch

from shardline.model.flops import FORMULA, flops_per_token, table_peak_tflops
from shardline.planning.cost import devices, estimate_step
from shardline.planning.devices import Device, planned_precision
from shardline.planning.fixes import Suggestion
from shardline.planning.memory import MemoryPlan, gib, model_shape, plan_memory
from shardline.planning.moe import all_to_all_bytes, capacity_share, expert_shards, mlp_saved_bytes
from shardline.planning.offload import offload_cost
from shardline.planning.step_time import planned_counts
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


def imbalance_headroom(spec: JobSpec, device: Device, most: float) -> float:
    """The largest share of routed copies (1: balanced) the busiest expert-parallel rank may compute, up to `most`,
    at which the plan still fits `device`, to 0.01; 0 when balanced routing does not fit."""
    if not plan_memory(spec, device).fits:
        return 0.0
    low, high = 1.0, most
    if plan_memory(spec, device, imbalance=high).fits:
        return high
    while high - low > 0.01:
        mid = (low + high) / 2
        low, high = (mid, high) if plan_memory(spec, device, imbalance=mid).fits else (low, mid)
    return low


def mixture_lines(spec: JobSpec, plan: MemoryPlan, device: Device) -> list[str]:
    """A mixture of experts' lines: total and active parameters, the FLOPs per token (MFU's numerator) with its
    formula, how the experts are split, and the routing the plan assumes with the headroom left for imbalance
    (with a capacity factor: the bound the capacity puts on a rank's routed copies, which the plan is sized at)."""
    shape, p, t = model_shape(spec.model), spec.parallel, spec.train
    e, counts = shape.moe, planned_counts(spec)
    experts = counts.experts_trainable + counts.experts_frozen
    active = counts.active_trainable + counts.active_frozen + (0 if counts.tied else counts.embedding)
    per_token = flops_per_token(counts, shape.layers, shape.heads * shape.hd, t.seq_len, shape.windows)
    lines = [f"parameters: {plan.total_params / 1e9:.3g}B in all, {active / 1e9:.3g}B active per token (top-{e.top_k} "
             f"of {e.count} routed experts: N_active = N − (1 − k/E)·N_experts, N_experts {experts / 1e9:.3g}B)",
             f"model FLOPs per token at seq {t.seq_len}: {per_token / 1e9:.4g} GFLOP, from the active parameters "
             f"(MFU's numerator): {FORMULA}",
             expert_shards(shape, p.ep, plan.dp_shard)]
    n, c = t.micro_batch_size * t.seq_len, 2 if planned_precision(t.precision, device) == "bf16" else 4
    factor = t.expert_capacity_factor
    share = capacity_share(shape, n, p.ep, factor) if factor else 1.0
    router = (c + 4) * e.count * n
    routed = mlp_saved_bytes(shape, c, not spec.model.lora.enabled, share) * n - router
    lines.append(f"per MoE layer and micro-batch of {n:,} tokens: router logits and probabilities "
                 f"{router / 2**20:,.0f} MiB, the routed copies' saved activations {routed / 2**30:.2f} GiB (every "
                 f"layer without AC, one with full AC), all-to-all buffers "
                 f"{all_to_all_bytes(shape, c, p.ep, share) * n / 2**20:,.0f} MiB while it runs backward")
    copies = n * e.top_k
    if factor:
        capacity = math.ceil(n * e.top_k / e.count * factor)
        lines.append(f"routing: capacity factor {factor:g} (train.expert_capacity_factor): each expert takes at most "
                     f"{capacity:,} routed copies of a rank's micro-batch, so each "
                     f"{'EP rank' if p.ep > 1 else 'rank'} computes at most {round(share * copies):,} "
                     f"({share:.2f}× the balanced {copies:,}); this plan sizes the routed copies' activations and "
                     "all-to-all buffers at that bound, whatever the routing (copies over it are dropped: the "
                     "step's expert_dropped metric)")
        return lines
    if p.ep == 1:
        lines.append(f"routing: no expert parallel, every rank computes its own {copies:,} routed copies per "
                     "micro-batch, whatever the routing (balanced or not, the same memory)")
        return lines
    most = float(p.ep)  # every EP rank sending all its copies to one rank's experts
    headroom = imbalance_headroom(spec, device, most)
    where = (f"fits even if one rank computed every copy of its EP group ({most:g}×)" if headroom >= most
             else f"fits while the busiest EP rank computes up to {headroom:.2f}× its balanced share"
             if headroom else "does not fit even balanced")
    lines.append(f"routing: this plan and the dry run assume balanced routing ({copies:,} routed copies per "
                 f"micro-batch sent and received by each EP rank); {where} (the step's expert_imbalance metric is "
                 "the busiest expert's share: watch it against this)")
    return lines
