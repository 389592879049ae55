"""What makes a spec fit its device, in the order a user would try it (`shardline plan`'s suggestions):

1. the same devices: activation checkpointing, a smaller micro-batch (same global batch), full sharding;
2. QLoRA, for a LoRA run: the frozen base as NF4 (`model.lora.quantize_base: nf4`), with 1.'s changes;
3. more devices: 2×, 4×, 8× the world (up to 8 GPUs a node, then nodes), with 1.'s changes;
4. offload (GPUs): parameters, gradients and AdamW state in host memory, on the same then more devices; its host
   memory and modelled slowdown: `shardline.planning.offload`.

Each kind gives its first layout that fits, least disruptive first (the AC level varies fastest).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pydantic import ValidationError

from shardline.errors import SpecError
from shardline.planning.devices import Device
from shardline.planning.memory import MemoryPlan, as_device, model_shape, plan_memory
from shardline.spec import JobSpec
from shardline.spec.resolve import set_field

AC_ORDER = ("none", "selective", "full")
KINDS = ("checkpointing and micro-batch", "QLoRA", "more devices", "offload")
GPUS_PER_NODE = 8
MAX_FACTOR = 8


@dataclass(frozen=True)
class Suggestion:
    overrides: list[str]
    plan: MemoryPlan
    kind: str = KINDS[0]
    spec: JobSpec | None = None
    """The spec with the change applied."""

    @property
    def command_line(self) -> str:
        return " ".join(f"--set {o}" for o in self.overrides)


def _variant(spec: JobSpec, changes: dict[str, object]) -> JobSpec | None:
    data = spec.model_dump(mode="json")
    for key, value in changes.items():
        set_field(data, key, value)
    try:
        return JobSpec.model_validate(data)
    except (ValidationError, SpecError):
        return None


def _get(spec: JobSpec, key: str) -> object:
    value: object = spec
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _same_devices(spec: JobSpec) -> Iterator[dict[str, object]]:
    """AC level (inner), micro-batch, full sharding (outer) on the spec's devices."""
    p, t = spec.parallel, spec.train
    current = AC_ORDER.index(p.activation_checkpointing)
    acs: list[dict[str, object]] = [{}]
    for level in AC_ORDER[max(current, 1):]:
        if level != p.activation_checkpointing or p.activation_checkpointing_every != 1:
            acs.append({"parallel.activation_checkpointing": level, "parallel.activation_checkpointing_every": 1})
    micro = [t.micro_batch_size]
    while micro[-1] % 2 == 0:
        micro.append(micro[-1] // 2)
    for replicate in [p.dp_replicate] + ([1] if p.dp_replicate > 1 else []):
        for mb in micro:
            for ac in acs:
                change: dict[str, object] = {}
                if replicate != p.dp_replicate:
                    change |= {"parallel.dp_replicate": 1, "parallel.dp_shard": spec.world_size // p.ranks_per_row}
                if mb != t.micro_batch_size:
                    change["train.micro_batch_size"] = mb
                yield change | ac


def _more_devices(spec: JobSpec) -> Iterator[dict[str, object]]:
    """2×, 4×, 8× the world, fully sharded, each with the same-device changes."""
    p, world = spec.parallel, spec.world_size
    factor = 2
    while factor <= MAX_FACTOR:
        devices = world * factor
        per_node = min(max(p.nproc_per_node or 1, min(devices, GPUS_PER_NODE)), devices)
        layout: dict[str, object] = {"parallel.nproc_per_node": per_node, "launch.nnodes": devices // per_node}
        if p.dp_shard is not None or p.dp_replicate > 1:  # else FSDP over all the devices by default
            layout |= {"parallel.dp_replicate": 1, "parallel.dp_shard": devices // p.ranks_per_row}
        for change in _same_devices(spec):
            yield layout | {k: v for k, v in change.items() if not k.startswith("parallel.dp_")}
        factor *= 2


def _candidates(spec: JobSpec, device: Device) -> Iterator[tuple[str, dict[str, object]]]:
    lora = spec.model.lora
    for change in _same_devices(spec):
        yield KINDS[0], change
    # a mixture of experts' base is not quantized (shardline.model.lora refuses NF4 with experts)
    if lora.enabled and lora.quantize_base != "nf4" and model_shape(spec.model).moe is None:
        for change in _same_devices(spec):
            yield KINDS[1], {"model.lora.quantize_base": "nf4"} | change
    if device.kind == "cpu":  # more processes on one host share its memory: nothing more fits
        return
    for change in _more_devices(spec):
        yield KINDS[2], change
    if not spec.parallel.offload:
        for change in [*_same_devices(spec), *_more_devices(spec)]:
            yield KINDS[3], {"parallel.offload": True} | change


def fixes(spec: JobSpec, device: Device | str | None = None) -> list[Suggestion]:
    """The first layout of each kind that fits `device` (in `KINDS` order); [] when `spec` already fits."""
    dev = as_device(device)
    if plan_memory(spec, dev).fits:
        return []
    found: dict[str, Suggestion] = {}
    for kind, change in _candidates(spec, dev):
        if kind in found:
            continue
        variant = _variant(spec, change)
        if variant is None:
            continue
        plan = plan_memory(variant, dev)
        if plan.fits:
            shown = {k: v for k, v in change.items() if _get(spec, k) != v}
            overrides = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in shown.items()]
            found[kind] = Suggestion(overrides, plan, kind, variant)
    return [found[k] for k in KINDS if k in found]


def suggest(spec: JobSpec, device: Device | str | None = None, offload: bool = True) -> Suggestion | None:
    """The first change that makes `spec` fit `device` (`fixes`' order), or None (it fits, or nothing found)."""
    return next((f for f in fixes(spec, device) if offload or f.kind != "offload"), None)
