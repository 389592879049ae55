"""What a run costs: the one price table, the price a run pays, the projection `shardline plan` prints,
and the meter that puts dollars on every step record (docs/architecture.md §5: `cost_usd`).

Money is device-hours × $/device-hour. A *device* is one rank: a GPU, or on CPU one worker process (there
is no table price for CPUs — a CPU run is priced only when the spec gives `cost.usd_per_device_hour`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shardline.errors import SpecError
from shardline.hardware import PRICES_AS_OF, match_device
from shardline.hardware import price_table as catalogue_price_table
from shardline.jsonl import read_jsonl
from shardline.precision import choose_precision
from shardline.procfs import process_age

if TYPE_CHECKING:
    from shardline.spec import JobSpec


def price_table(spec: JobSpec) -> dict[str, dict[str, float]]:
    """The catalogue's prices (hardware.py) with the spec's `cost.prices` merged over them, $/GPU-hour per
    accelerator key and provisioning model (`PROVISIONING`)."""
    return catalogue_price_table(spec.cost.prices)


def device_key(device_name: str) -> str | None:
    """Price-table key of a device name as CUDA reports it ('NVIDIA H100 80GB HBM3' → 'h100'): the catalogue
    key (hardware.match_device), also for a GPU the table has no price for; None if not catalogued."""
    gpu = match_device(device_name)
    return None if gpu is None else gpu.key


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
    (global batch × seq len tokens; packing fills ~95-99 %, so this is slightly pessimistic); a DPO run whose
    reference is the adapters off, and a GRPO run with a KL, also run the reference's forward every step; full
    activation checkpointing runs its blocks' forward again (`shardline.planning.step_time`)."""
    from shardline.planning.step_time import step_time

    return step_time(spec, peak_tflops).seconds


def _sampling_lines(spec: JobSpec, peak: float, gpu, train_s: float) -> tuple[float, str] | None:
    """GRPO: the sampling's seconds per step and what `plan` says of it; None for other objectives."""
    from shardline.planning.rollout import rollout_estimate

    if spec.train.objective != "grpo":
        return None
    r = rollout_estimate(spec, peak, gpu)
    share = r.seconds / (r.seconds + train_s)
    verdict = "generation dominates the step" if share > 0.5 else "training dominates the step"
    calls = f"{spec.train.grpo.oversample} × " if spec.train.grpo.oversample > 1 else ""
    return r.seconds, (f"GRPO sampling: {calls}{r.sequences} sequences per rank × {spec.train.grpo.max_new_tokens} new "
                       f"tokens, KV cache up to {r.kv_cache_bytes / 2**30:.3g} GiB per rank; ≥ {r.seconds:.3g} s/step "
                       f"({r.bound}-bound decode) vs {train_s:.3g} s/step training: {verdict} ({100 * share:.0f}%)")


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

    def summary_line(self) -> str | None:
        """The cost line of the end-of-run summary, or None when the run had no price."""
        summary = self.summary()
        total = summary["cost_usd_total"]
        if total is None:
            return None
        per_m = summary.get("cost_usd_per_1m_tokens")
        per_m = f", ${per_m:.4g} per 1M tokens" if per_m is not None else ""
        return (f"cost: ${total:.4g} in total{per_m} (${summary['usd_per_device_hour']:.4g}/device-hour × "
                f"{summary['cost_devices']} devices, {summary['price_source']})")

    def describe(self) -> str:
        if not self.price.known:
            return f"cost: not tracked ({self.price.source})"
        return (f"cost: ${self.price.usd_per_device_hour:.4g}/device-hour × {self.devices} devices "
                f"({self.price.source})")


def process_started_monotonic() -> float:
    """`time.monotonic()` at this process's start (Linux /proc), so that the devices are billed from the
    worker's start — imports, model loading — not from its first step; now where /proc is unavailable."""
    return time.monotonic() - (process_age() or 0.0)


def previous_cost_usd(metrics_file: Path) -> float:
    """The cumulative `cost_usd` the run's earlier attempts recorded last (0 for a new run)."""
    last = 0.0
    for record in read_jsonl(metrics_file):
        last = float(record.get("cost_usd") or last)
    return last


def estimate_step(spec: JobSpec, device_kind: str, device_name: str) -> tuple[float, str, str | None]:
    """(seconds per step, where the figure comes from, GRPO's sampling line or None) before a run: the catalogue's
    peak of the GPU (or the CPU probe ÷ the node's processes) at `cost.assumed_mfu`, recompute and NF4
    dequantization included (`shardline.planning.step_time`)."""
    import torch

    from shardline.model.flops import probe_cpu_peak_tflops, table_peak_tflops
    from shardline.planning.step_time import step_time

    gpu = match_device(device_name) if device_kind == "cuda" else None
    precision = choose_precision(spec.train.precision, accelerator=device_kind != "cpu",
                                 native_bf16=gpu is None or gpu.bf16_tflops is not None).precision
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    if spec.train.peak_tflops is not None:
        peak, where = spec.train.peak_tflops, "train.peak_tflops"
    elif device_kind in ("cuda", "tpu") and (table := table_peak_tflops(device_name, dtype)) is not None:
        peak, where = table, f"{device_name} dense {precision}"
    else:  # this host's CPU, shared by the node's processes as in training
        peak, by = probe_cpu_peak_tflops(dtype, seconds=0.1)
        peak /= spec.parallel.nproc_per_node or 1
        where = f"probe: best {by} matmul on this host ÷ {spec.parallel.nproc_per_node} processes"
    fp8 = gpu.fp8_tflops if gpu is not None and spec.train.peak_tflops is None and precision == "bf16" else None
    parts = step_time(spec, peak, gpu.hbm_gbps if gpu is not None else None, 2 if precision == "bf16" else 4, fp8)
    step_s = parts.seconds
    source = (f"estimated: {100 * spec.cost.assumed_mfu:.0f}% MFU (cost.assumed_mfu) of {peak:.4g} TFLOP/s "
              f"({where}){parts.describe()}")
    sampling = _sampling_lines(spec, peak, gpu, step_s)
    if sampling is None:
        return step_s, source, None
    return step_s + sampling[0], source + "; GRPO's sampling included", sampling[1]


def devices(n: int) -> str:
    return f"{n} device{'s' if n != 1 else ''}"


def time_line(spec: JobSpec, step_s: float, source: str, fits: bool = True) -> str:
    """`plan`'s line of the run's duration: `train.max_steps` × seconds per step, on the spec's devices (a layout
    that does not fit says so: each way to fit has its own time)."""
    hours = spec.train.max_steps * step_s / 3600
    lead = "time" if fits else "time as given, which does not fit (each way to fit below has its own)"
    return (f"{lead}: {spec.train.max_steps} steps × {step_s:.3g} s/step = {hours:.3g} h on {devices(spec.world_size)} "
            f"({source}); startup, evaluation and checkpoint time not included")


def plan_cost_lines(spec: JobSpec, device_kind: str, device_name: str, from_run: Path | None = None,
                    fits: bool = True) -> list[str]:
    """What `shardline plan` prints about time and money: the projected cost of `train.max_steps` steps."""
    sampling = None
    if from_run is not None:
        step_s, source = measured_step_time(spec, from_run)
    else:
        step_s, source, sampling = estimate_step(spec, device_kind, device_name)
    key = device_name if device_kind in ("cuda", "tpu") else "cpu"
    p = project_cost(spec, key, step_s, source)
    lines = [time_line(spec, step_s, source, fits)]
    if sampling:
        lines.append(sampling)
    if p.total_usd is None:
        lines.append(f"cost: unknown — {p.price.source}")
    else:
        lines.append(f"cost: ${p.total_usd:,.2f} = {p.hours * p.devices:,.3g} device-hours × "
                     f"${p.price.usd_per_device_hour:.4g}/device-hour ({p.price.source})")
    if p.by_provisioning:
        lines.append("by provisioning: " + " · ".join(f"{k} ${v:,.2f}" for k, v in p.by_provisioning.items()))
    return lines
