"""Device capacities and the fixed per-process memory the planner adds to tensor bytes.

Capacities are the totals `nvidia-smi` reports (what the CUDA allocator can ever use), in MiB.
Runtime constants live here, in one place, with how they were obtained.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardline.errors import SpecError

MiB, GiB = 2**20, 2**30

# CUDA: context + cuBLAS/NCCL workspaces + caching-allocator fragmentation. Not measured here (no GPU);
# a typical H100 process shows ~0.5 GiB of context and ~0.5-1 GiB of NCCL/cuBLAS buffers and allocator
# slack beyond `max_memory_allocated`. It counts for "fits", not for the planned-vs-measured comparison,
# because the trainer's CUDA metric is `max_memory_allocated` (tensors only).
CUDA_RUNTIME_BYTES = int(1.5 * GiB)

# CPU: resident runtime of a worker before any model tensor: python + torch 2.13 (CPU) + transformers 5.23 +
# peft + shardline imports, the gloo process group, one tiny Llama forward/backward. Measured as the peak
# RSS of a fresh process running `measure_cpu_runtime_bytes()` on the 2-core dev machine: 380.6 MiB (3 runs);
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

    @property
    def runtime_bytes(self) -> int:
        return CUDA_RUNTIME_BYTES if self.kind == "cuda" else CPU_RUNTIME_BYTES


# key → (display name, nvidia-smi total MiB). Lookup of a CUDA device name: first substring match wins.
GPUS: dict[str, tuple[str, int]] = {
    "b200": ("B200 180GB", 183_359),
    "h200": ("H200 141GB", 143_771),
    "h100": ("H100 80GB", 81_559),
    "a100": ("A100 80GB", 81_920),
    "l4": ("L4 24GB", 23_034),
}


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
    return [*GPUS, "cpu"]


def get_device(name: str, memory_gb: float | None = None) -> Device:
    """A device from the table (`h100`, `h200`, `b200`, `a100`, `l4`, `cpu`); `memory_gb` (GiB) overrides."""
    key = name.lower()
    if key == "cpu":
        device = Device("cpu (host RAM)", host_memory_bytes(), "cpu")
    elif key in GPUS:
        label, mib = GPUS[key]
        device = Device(label, mib * MiB, "cuda")
    else:
        raise SpecError("--device", f"unknown device {name!r}", f"choose one of {', '.join(device_names())} "
                        "or give --memory-gb")
    if memory_gb is not None:
        device = Device(f"{device.name}, {memory_gb:g} GiB given", int(memory_gb * GiB), device.kind)
    return device


def current_device() -> Device:
    """The device this process trains on: the CUDA GPU (table or its reported total) or the host."""
    import torch

    if not torch.cuda.is_available():
        return get_device("cpu")
    gpu = torch.cuda.get_device_name()
    for key, (label, mib) in GPUS.items():
        if key in gpu.lower():
            return Device(label, mib * MiB, "cuda")
    return Device(gpu, torch.cuda.get_device_properties(0).total_memory, "cuda")


def measure_cpu_runtime_bytes() -> int:
    """Re-measure `CPU_RUNTIME_BYTES`: run this in a fresh process (peak RSS is a process-lifetime maximum)."""
    import os
    import resource

    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import shardline.worker  # noqa: F401 - the worker's imports (trainer, data, peft)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                         num_attention_heads=1, num_key_value_heads=1))
    model(input_ids=torch.randint(0, 256, (1, 16))).logits.sum().backward()
    dist.destroy_process_group()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
