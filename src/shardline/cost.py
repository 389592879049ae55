"""What a run costs: the one price table, the price a run pays, the projection `shardline plan` prints,
and the meter that puts dollars on every step record (DESIGN.md §3: `cost_usd`).

Money is device-hours × $/device-hour. A *device* is one rank: a GPU, or on CPU one worker process (there
is no table price for CPUs — a CPU run is priced only when the spec gives `cost.usd_per_device_hour`).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shardline.errors import SpecError

if TYPE_CHECKING:
    from shardline.spec import JobSpec

PROVISIONING = ("on-demand", "spot", "dws-flex-start", "reservation")

# $/GPU-hour: the whole accelerator-optimized VM (GPU + its bundled vCPUs, memory, local SSD) divided by
# its GPUs (a3-highgpu-8g H100, a3-ultragpu-8g H200, a4-highgpu-8g B200, a2-ultragpu-1g A100 80GB,
# g2-standard-8 L4), approximate Google Cloud us-central1 list prices of mid-2025 (source: the public pages
# cloud.google.com/compute/gpus-pricing, /compute/vm-instance-pricing, /spot-vms/pricing; not re-checked
# since — verify before relying on them). List prices change, spot prices move daily, and all differ by
# region and contract:
# - spot: the spot list price of that day (varies; up to 91 % off);
# - dws-flex-start: Dynamic Workload Scheduler flex-start (queued, up to 7 days, no preemption), which
#   Google prices at a discount of roughly 50 % off on-demand for GPUs;
# - reservation: a 1-year committed-use price for reserved capacity.
# Put your own (negotiated) prices in the spec: `cost.prices` or `cost.usd_per_device_hour`.
PRICES_USD_PER_GPU_HOUR: dict[str, dict[str, float]] = {
    #          on-demand  spot   dws-flex-start  reservation
    "b200": {"on-demand": 14.27, "spot": 5.10, "dws-flex-start": 7.14, "reservation": 9.99},
    "h200": {"on-demand": 10.85, "spot": 3.72, "dws-flex-start": 5.43, "reservation": 7.60},
    "h100": {"on-demand": 11.06, "spot": 3.72, "dws-flex-start": 5.53, "reservation": 7.74},
    "a100": {"on-demand": 5.07, "spot": 1.57, "dws-flex-start": 2.54, "reservation": 3.19},
    "l4": {"on-demand": 0.85, "spot": 0.31, "dws-flex-start": 0.43, "reservation": 0.54},
}
PRICES_AS_OF = "2025-06, GCP us-central1 list prices (approximate)"


def price_table(spec: JobSpec) -> dict[str, dict[str, float]]:
    """The table with the spec's `cost.prices` entries merged over it (per GPU, per provisioning model)."""
    table = {gpu: dict(row) for gpu, row in PRICES_USD_PER_GPU_HOUR.items()}
    for gpu, row in spec.cost.prices.items():
        table.setdefault(gpu.lower(), {}).update(row)
    return table


def device_key(device_name: str) -> str | None:
    """Price-table key of a device name as CUDA reports it ('NVIDIA H100 80GB HBM3' → 'h100'); None if unknown.
    Whole-word match, so an L40S is not priced as an L4."""
    name = device_name.lower()
    for key in PRICES_USD_PER_GPU_HOUR:
        if re.search(rf"(?<![a-z0-9]){re.escape(key)}(?![a-z0-9])", name):
            return key
    return None


def check_cost(spec: JobSpec) -> None:
    """Spec rules for the `cost` section (called from the spec's validator)."""
    c = spec.cost
    for gpu, row in c.prices.items():
        for provisioning, usd in row.items():
            if usd < 0:
                raise SpecError(f"cost.prices.{gpu}.{provisioning}", f"{usd} is negative",
                                "give the price of one GPU-hour in US dollars (≥ 0)")
    if c.usd_per_device_hour is None and c.gpu is not None:
        table = price_table(spec)
        gpu = c.gpu.lower()
        if gpu not in table:
            raise SpecError("cost.gpu", f"{c.gpu!r} is not in the price table",
                            f"use one of {', '.join(table)}, add its prices under cost.prices.{gpu}, "
                            "or set cost.usd_per_device_hour")
        if c.provisioning not in table[gpu]:
            raise SpecError("cost.provisioning", f"no {c.provisioning} price for {gpu}",
                            f"add cost.prices.{gpu}.{c.provisioning} or choose one of {', '.join(table[gpu])}")


@dataclass(frozen=True)
class Price:
    usd_per_device_hour: float | None
    source: str  # where the number came from, or why there is none

    @property
    def known(self) -> bool:
        return self.usd_per_device_hour is not None


def resolve_price(spec: JobSpec, device: str | None) -> Price:
    """The $/device-hour a run pays. `device` is what it runs on: a table key, a CUDA device name, or 'cpu'.

    Order: `cost.usd_per_device_hour`, then the table (with `cost.prices`) for `cost.gpu` or the device.
    """
    c = spec.cost
    if c.usd_per_device_hour is not None:
        return Price(c.usd_per_device_hour, "cost.usd_per_device_hour")
    table = price_table(spec)
    key = (c.gpu or "").lower() or (device.lower() if device and device.lower() in table else None)
    if key is None and device:
        key = device_key(device)
    if key is None:
        what = device or "this device"
        return Price(None, f"no price for {what}: set cost.usd_per_device_hour (or cost.gpu to use the table)")
    usd = table.get(key, {}).get(c.provisioning)
    if usd is None:
        return Price(None, f"no {c.provisioning} price for {key}: add cost.prices.{key}.{c.provisioning}")
    custom = any(gpu.lower() == key and c.provisioning in row for gpu, row in c.prices.items())
    source = f"cost.prices.{key}.{c.provisioning}" if custom else f"table: {key} {c.provisioning}, {PRICES_AS_OF}"
    return Price(usd, source)


def usd(device_seconds: float, price: Price) -> float | None:
    return None if price.usd_per_device_hour is None else device_seconds / 3600 * price.usd_per_device_hour


# ---- before the run: the projection `shardline plan` prints --------------------------------------------
@dataclass(frozen=True)
class CostProjection:
    steps: int
    step_time_s: float
    throughput_source: str
    devices: int
    price: Price
    by_provisioning: dict[str, float]  # $ of the whole run under each provisioning model of the device's row

    @property
    def hours(self) -> float:
        return self.steps * self.step_time_s / 3600

    @property
    def total_usd(self) -> float | None:
        return usd(self.steps * self.step_time_s * self.devices, self.price)


def estimated_step_time(spec: JobSpec, peak_tflops: float) -> float:
    """Seconds per optimizer step at `cost.assumed_mfu` of `peak_tflops` per device, with full rows
    (global batch × seq len tokens; packing fills ~95-99 %, so this is slightly pessimistic)."""
    from shardline.model.flops import ParamCounts, flops_per_token
    from shardline.plan import model_shape, param_budget

    shape = model_shape(spec.model)
    pb = param_budget(shape, spec.model.lora)
    embedding = shape.vocab * shape.hidden
    matmul = pb.total - embedding + (embedding if shape.tie else 0)  # lm_head counts even when tied
    trainable = pb.trainable if spec.model.lora.enabled else matmul
    counts = ParamCounts(trainable=trainable, frozen=matmul - trainable, embedding=embedding, tied=shape.tie)
    per_token = flops_per_token(counts, shape.layers, shape.hidden, spec.train.seq_len)
    tokens = spec.train.global_batch_size * spec.train.seq_len
    return per_token * tokens / (spec.world_size * peak_tflops * 1e12 * spec.cost.assumed_mfu)


def measured_step_time(spec: JobSpec, run_dir: Path) -> tuple[float, str]:
    """Seconds per step this spec would take, from a finished run's measured tokens/s per device.

    Scaled by tokens per step and world size, so a run of another length or world size still informs
    the estimate (assumes the same model, sequence length and device)."""
    summary_file = run_dir / "summary.json"
    if not summary_file.is_file():
        raise SpecError("--from-run", f"{run_dir} has no summary.json", "give a finished run directory")
    rate = json.loads(summary_file.read_text()).get("mean_tokens_per_s_per_device")
    if not rate:
        raise SpecError("--from-run", f"{summary_file} has no mean_tokens_per_s_per_device", "give a finished run")
    tokens = spec.train.global_batch_size * spec.train.seq_len
    return tokens / (rate * spec.world_size), f"measured: {rate:,.0f} tok/s/device in {run_dir.name}"


def project_cost(spec: JobSpec, device: str | None, step_time_s: float, throughput_source: str) -> CostProjection:
    price = resolve_price(spec, device)
    table = price_table(spec)
    key = (spec.cost.gpu or "").lower() or (device_key(device) if device else None) or ""
    device_s = spec.train.max_steps * step_time_s * spec.world_size
    by_model = {p: device_s / 3600 * v for p, v in table.get(key, {}).items()}
    return CostProjection(spec.train.max_steps, step_time_s, throughput_source, spec.world_size, price, by_model)


# ---- during the run: dollars on every step record -------------------------------------------------------
class CostMeter:
    """Adds `cost_usd_step` (this step's device time), `cost_usd` (the run so far: wall time since the
    worker started, all devices, plus what earlier attempts of the run cost) and `cost_usd_per_1m_tokens`
    (this step) to each train record. Without a price the fields are absent, never zero."""

    def __init__(self, price: Price, devices: int, previous_usd: float = 0.0, started: float | None = None) -> None:
        self.price, self.devices, self.previous_usd = price, devices, previous_usd
        self.started = time.monotonic() if started is None else started
        self.tokens = 0

    def total_usd(self) -> float | None:
        spent = usd((time.monotonic() - self.started) * self.devices, self.price)
        return None if spent is None else self.previous_usd + spent

    def on_step(self, record: dict) -> dict:
        self.tokens += int(record.get("tokens_total") or 0)
        step_usd = usd(record["step_time_s"] * self.devices, self.price)
        if step_usd is None:
            return {}
        fields = {"cost_usd_step": step_usd, "cost_usd": self.total_usd()}
        if record.get("tokens_total"):
            fields["cost_usd_per_1m_tokens"] = step_usd / record["tokens_total"] * 1e6
        return fields

    def summary(self) -> dict:
        total = self.total_usd()
        out = {"cost_usd_total": None if total is None else round(total, 6),
               "usd_per_device_hour": self.price.usd_per_device_hour, "price_source": self.price.source,
               "cost_devices": self.devices}
        if total is not None and self.tokens:
            out["cost_usd_per_1m_tokens"] = round(total / self.tokens * 1e6, 6)
        return out

    def describe(self) -> str:
        if not self.price.known:
            return f"cost: not tracked ({self.price.source})"
        return (f"cost: ${self.price.usd_per_device_hour:.4g}/device-hour × {self.devices} devices "
                f"({self.price.source})")


def process_started_monotonic() -> float:
    """`time.monotonic()` at this process's start (Linux /proc), so that the devices are billed from the
    worker's start — imports, model loading — not from its first step; now where /proc is unavailable."""
    import os

    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        age = 0.0
    return time.monotonic() - age


def previous_cost_usd(metrics_file: Path) -> float:
    """The cumulative `cost_usd` the run's earlier attempts recorded last (0 for a new run)."""
    if not metrics_file.is_file():
        return 0.0
    last = 0.0
    with metrics_file.open() as f:
        for line in f:
            if '"cost_usd"' in line:
                try:
                    last = float(json.loads(line).get("cost_usd") or last)
                except ValueError:
                    continue  # a torn last line from a killed attempt
    return last


def plan_cost_lines(spec: JobSpec, device_kind: str, device_name: str, from_run: Path | None = None) -> list[str]:
    """What `shardline plan` prints about money: the projected cost of `train.max_steps` steps."""
    import torch

    from shardline.model.flops import probe_matmul_tflops, table_peak_tflops

    if from_run is not None:
        step_s, source = measured_step_time(spec, from_run)
    else:
        dtype = torch.bfloat16 if spec.train.precision == "bf16" else torch.float32
        if spec.train.peak_tflops is not None:
            peak, where = spec.train.peak_tflops, "train.peak_tflops"
        elif device_kind == "cuda" and (table := table_peak_tflops(device_name, dtype)) is not None:
            peak, where = table, f"{device_name} dense {spec.train.precision}"
        else:  # this host's CPU, shared by the node's processes as in training
            peak = probe_matmul_tflops(dtype, torch.device("cpu"), seconds=0.2) / (spec.parallel.nproc_per_node or 1)
            where = f"probe: {spec.train.precision} matmul on this host ÷ {spec.parallel.nproc_per_node} processes"
        step_s = estimated_step_time(spec, peak)
        source = f"estimated: {100 * spec.cost.assumed_mfu:.0f}% MFU (cost.assumed_mfu) of {peak:.4g} TFLOP/s ({where})"
    key = device_name if device_kind == "cuda" else "cpu"
    p = project_cost(spec, key, step_s, source)
    lines = [f"time: {p.steps} steps × {p.step_time_s:.3g} s/step = {p.hours:.3g} h on {p.devices} devices "
             f"({source}); startup, evaluation and checkpoint time not included"]
    if p.total_usd is None:
        lines.append(f"cost: unknown — {p.price.source}")
    else:
        lines.append(f"cost: ${p.total_usd:,.2f} = {p.hours * p.devices:,.3g} device-hours × "
                     f"${p.price.usd_per_device_hour:.4g}/device-hour ({p.price.source})")
    if p.by_provisioning:
        lines.append("by provisioning: " + " · ".join(f"{k} ${v:,.2f}" for k, v in p.by_provisioning.items()))
    return lines
