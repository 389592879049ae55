"""Devices the planner plans for, and the fixed per-process memory it adds to tensor bytes.

GPU capacities come from the hardware catalogue (hardware.py: the totals `nvidia-smi` reports).
Runtime constants live here, in one place, with how they were obtained.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardline.errors import SpecError
from shardline.hardware import GPUS, match_device
from shardline.precision import choose_precision

MiB, GiB = 2**20, 2**30

# CUDA: context + cuBLAS/NCCL workspaces + caching-allocator fragmentation. Not measured here (no GPU);
# a typical H100 process shows ~0.5 GiB of context and ~0.5-1 GiB of NCCL/cuBLAS buffers and allocator
# slack beyond `max_memory_allocated`. It counts for "fits", not for the planned-vs-measured comparison,
# because the trainer's CUDA metric is `max_memory_allocated` (tensors only).
CUDA_RUNTIME_BYTES = int(1.5 * GiB)

# CPU: resident runtime of a worker before any model tensor: python + torch 2.13 (CPU) + transformers 5.23 +
# peft + shardline imports, the gloo process group, one tiny Llama forward/backward. Measured as the peak
# RSS of a fresh process running `bench/cpu_runtime.py` on the 2-core dev machine: 380.6 MiB (3 runs);
# a real worker (tokenizer and data memory maps loaded) read 382 MiB just before building its model.
CPU_RUNTIME_BYTES = 382 * MiB

# CPU: glibc malloc keeps freed heap memory resident: its mmap threshold rises to the largest block freed
# (up to 32 MiB), so activations come from the brk heap, and chunks allocated mid-step (gradients, optimizer
# state) pin the heap top above freed ones. Fitted on 11 single-process runs (hidden 256-512, 4-16 layers,
# fp32/bf16, AC none/full/selective; peak RSS after 3 steps minus runtime minus live tensor bytes, which
# the planner matched within 3 %, selective AC +10 %): retained ≈ 1/3 of the transient bytes (everything but sharded
# state) + one block's saved activations, or 3 when blocks are recomputed (AC). Residuals: -9 … +12 %.
CPU_RETAINED_TRANSIENT = 1 / 3
CPU_RETAINED_BLOCKS_RECOMPUTE = 3.0
CPU_RETAINED_BLOCKS_PLAIN = 1.0


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int
    kind: str  # "cuda" | "cpu"
    native_bf16: bool = True
    """A GPU with bf16 tensor cores (the catalogue gives it a bf16 peak; T4 and V100 have none). For the CPU,
    `train.precision: auto` reads the CPU's own flags."""

    @property
    def runtime_bytes(self) -> int:
        return CUDA_RUNTIME_BYTES if self.kind == "cuda" else CPU_RUNTIME_BYTES


def host_memory_bytes() -> int:
    """MemTotal from /proc/meminfo (0 where unavailable)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def device_names() -> list[str]:
    return [*(gpu.key for gpu in GPUS), "cpu"]


def get_device(name: str, memory_gb: float | None = None) -> Device:
    """`cpu` or a GPU of the catalogue (`h100`, `h200`, `b200`, `a100`, `l4`, …, or a name as CUDA reports it);
    `memory_gb` (GiB) overrides the capacity."""
    if name.lower() == "cpu":
        device = Device("cpu (host RAM)", host_memory_bytes(), "cpu")
    elif (gpu := match_device(name)) is not None and gpu.kind == "gpu":
        device = Device(gpu.name, gpu.memory_bytes, "cuda", gpu.bf16_tflops is not None)
    else:
        raise SpecError("--device", f"unknown device {name!r}", f"choose one of {', '.join(device_names())} "
                        "or give --memory-gb")
    if memory_gb is not None:
        device = Device(f"{device.name}, {memory_gb:g} GiB given", int(memory_gb * GiB), device.kind,
                        device.native_bf16)
    return device


def current_device() -> Device:
    """The device this process trains on: the CUDA GPU or the host."""
    import torch

    if not torch.cuda.is_available():
        return get_device("cpu")
    return cuda_device(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory)


def cuda_device(name: str, total_bytes: int) -> Device:
    """A CUDA device by the name it reports: the catalogue's entry, else that name and its reported total."""
    gpu = match_device(name)
    if gpu is None:
        return Device(name, total_bytes, "cuda")
    return Device(gpu.name, gpu.memory_bytes, "cuda", gpu.bf16_tflops is not None)


def planned_precision(requested: str, device: Device) -> str:
    """`train.precision` as a run on `device` would choose it (bf16 or fp32)."""
    return choose_precision(requested, accelerator=device.kind != "cpu", native_bf16=device.native_bf16).precision
