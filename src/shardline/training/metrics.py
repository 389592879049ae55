"""Step records (docs/architecture.md §5): one JSON object per line in metrics.jsonl, and the rank-0 step line."""

from __future__ import annotations

import json
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console

from shardline.clock import format_duration
from shardline.jsonl import end_torn_line
from shardline.run_status import eta_seconds


@dataclass
class TrainRecord:
    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int  # loss-bearing tokens in the global batch
    tokens_total: int  # non-padding tokens in the global batch
    step_time_s: float
    data_wait_s: float
    tokens_per_s_per_device: float  # non-padding tokens
    loss_tokens_per_s_per_device: float
    tflops_per_device: float  # model FLOPs (shardline.model.flops.FORMULA)
    mfu: float  # the headline: model FLOPs / the device's peak
    mfu_causal: float  # the same with the causal half of attention only
    hfu: float  # executed FLOPs (padding, attention as computed, recompute) / the peak
    mem_peak_bytes: int
    epoch: float
    # Per-rank step time (resilience/stragglers.py): the slowest rank's, the median rank's, and which rank.
    step_time_max_s: float | None = None
    step_time_median_s: float | None = None
    slowest_rank: int | None = None
    # train.objective: dpo — the global batch's pairs and their means (shardline.training.preference.mean_metrics)
    preference: dict | None = None
    # train.objective: grpo — the global batch's completions and their means (shardline.training.grpo.mean_metrics),
    # and the seconds this step spent sampling them (`generation_s`) and scoring them (`reward_s`)
    grpo: dict | None = None
    # a mixture of experts (shardline.model.moe.ExpertLoad): the step's tokens routed to each expert, summed over
    # its MoE layers and all ranks, and the imbalance: the largest over layers of busiest expert / mean expert
    expert_tokens: list[int] | None = None
    expert_imbalance: float | None = None
    # with train.expert_capacity_factor: the routed copies dropped over capacity in the step (all layers and ranks)
    expert_dropped: int | None = None


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: max allocated. CPU: this process image's peak RSS (VmHWM). Not ru_maxrss: Linux carries it
    across fork+exec, so a worker started by a large parent would report the parent's size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def loss_trend(first: float, last: float) -> str:
    """The run's loss from its first step to its last, as the summary line says it."""
    change = 1 - last / first if first else 0.0
    return f"loss {first:.3f} → {last:.3f} ({100 * abs(change):.0f}% {'lower' if change >= 0 else 'higher'})"


class MetricsWriter:
    """Appends records to metrics.jsonl and prints the human view; only rank 0 makes one.

    `cost` (a `shardline.cost.CostMeter`) adds the cost fields to train records; each of `sinks`
    (Prometheus, TensorBoard, W&B: shardline.observe) gets every record as written. A sink that raises is
    logged and dropped: observing a run must never stop it."""

    def __init__(self, path: Path, console: Console) -> None:
        self.path = path
        self.console = console
        self.cost = None
        self.sinks: list[Callable[[str, dict], None]] = []
        self.started = time.monotonic()
        self.step_times: list[float] = []
        path.parent.mkdir(parents=True, exist_ok=True)
        end_torn_line(path)

    def write(self, kind: str, record: dict) -> dict:
        if kind == "train" and self.cost is not None:
            record = record | self.cost.on_step(record)
        line = {"kind": kind, "time": round(time.time(), 3), **record}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        for sink in list(self.sinks):
            try:
                sink(kind, line)
            except Exception:
                logging.getLogger("shardline").exception("metrics sink %r failed; dropped", sink)
                self.sinks.remove(sink)
        return line

    def train(self, r: TrainRecord, max_steps: int) -> None:
        line = self.write("train", asdict(r))
        self.step_times.append(r.step_time_s)
        eta = eta_seconds(self.step_times, max_steps - r.step)
        cost = ""
        if "cost_usd_step" in line:
            cost = f"  ${line['cost_usd_step']:.3g}/step ${line.get('cost_usd_per_1m_tokens', 0):.3g}/1M tok"
            if line.get("cost_usd") is not None and r.step:
                cost += f"  ${line['cost_usd'] * max_steps / r.step:.4g} projected"
        pref = r.preference
        text = (f"step {r.step:>5}/{max_steps}  loss {r.loss:7.4f}  lr {r.lr:.2e}  gnorm {r.grad_norm:6.3f}  "
                + (f"acc {pref['accuracy']:4.2f} margin {pref['margin']:+7.4f}  " if pref else "")
                + (f"reward {r.grpo['reward']:6.3f} len {r.grpo['completion_length']:5.1f} "
                   f"gen {r.grpo['generation_s']:5.2f}s  " if r.grpo else "")
                + (f"experts max/mean {r.expert_imbalance:4.2f}  " if r.expert_imbalance is not None else "")
                + (f"dropped {r.expert_dropped:,}  " if r.expert_dropped is not None else "") +
                f"{r.tokens_per_s_per_device:8,.0f} tok/s/dev  {r.tflops_per_device:7.3f} TFLOP/s  "
                f"MFU {100 * r.mfu:5.1f}% (HFU {100 * r.hfu:5.1f}%)  "
                f"step {r.step_time_s:5.2f}s (data {r.data_wait_s * 1000:4.1f}ms)  "
                f"mem {r.mem_peak_bytes / 2**30:5.2f} GiB  "
                f"elapsed {format_duration(time.monotonic() - self.started)}"
                f"{f'  ETA {format_duration(eta)}' if eta is not None else ''}{cost}")
        self.console.print(text, highlight=False)
        logging.getLogger("shardline").info(text)  # `shardline logs --rank 0` shows the progress too
