"""A CPU worker's memory beyond its tensors: the runtime it holds before building the model, and what its kernel
caches and allocator grow to over a long run.

- runtime: the resident set (VmRSS) of the worker after imports, the process group, tokenizer and data maps, just
  before it builds the model (`resident_bytes`, read by the trainer); `plan` without a run uses
  `devices.CPU_RUNTIME_BYTES`, the same point measured on the development machine.
- steady-state growth: the peak RSS (VmHWM) keeps rising after the first steps as the run meets new shapes: packed
  documents of every length in per-document attention, and the generation of the evaluations (a new key length at
  every token). oneDNN keeps a primitive, with its JIT code, per shape (up to `ONEDNN_PRIMITIVE_CACHE_CAPACITY`,
  1,024 by default; about 40 % of the growth on AMX) and glibc keeps the heap those shapes fragmented. Both are
  bounded, so the plan adds what they reach: measured per CPU class as the default run's (`shardline train`, 2
  ranks, 500 steps, evaluations every 100) peak at its end minus the plan's tensors, retention and measured
  runtime; scaled by the primitive cache's capacity where it is set.
"""

from __future__ import annotations

import os

from shardline.precision import cpu_bf16_feature

MiB = 2**20
DEFAULT_PRIMITIVE_CACHE = 1024
PRIMITIVE_SHARE = 0.4  # of the growth, oneDNN's primitive cache (AMX, issue 53)

# Steady-state growth by the CPU's bf16 feature, in bytes, for a bf16 run (oneDNN's bf16 kernels):
# amx_bf16: the default run on a 2-vCPU Sapphire Rapids (issue 53): 1.01 GiB measured at step 500 against 0.62 GiB
#   planned with a 382 MiB runtime: 400 MiB.
# avx512_bf16: the default run on this 2-core EPYC (2026-11-28, README): 0.86 GiB at step 500 against 0.62: 245 MiB.
# An fp32 run (AVX2, or fp32 asked for) goes through MKL's sgemm and oneDNN's fp32 kernels: not measured; the
# AVX512_BF16 figure stands in.
STEADY_GROWTH_BYTES = {"amx_bf16": 400 * MiB, "avx512_bf16": 245 * MiB}
FP32_GROWTH_BYTES = STEADY_GROWTH_BYTES["avx512_bf16"]


def resident_bytes() -> int:
    """This process's resident set now (VmRSS), 0 where /proc is unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def steady_growth_bytes(compute_bytes: int, cpuinfo: str | None = None) -> tuple[int, str]:
    """(bytes, what they are measured on) that a long CPU run's kernel caches and allocator add to its peak."""
    feature = cpu_bf16_feature(cpuinfo)
    if compute_bytes == 2 and feature in STEADY_GROWTH_BYTES:
        growth, basis = STEADY_GROWTH_BYTES[feature], feature
    else:
        growth, basis = FP32_GROWTH_BYTES, "fp32: avx512_bf16's"
    capacity = int(os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", DEFAULT_PRIMITIVE_CACHE))
    if capacity != DEFAULT_PRIMITIVE_CACHE:  # the primitive cache's share scales with its capacity
        growth = int(growth * (1 - PRIMITIVE_SHARE + PRIMITIVE_SHARE * capacity / DEFAULT_PRIMITIVE_CACHE))
        basis += f", {capacity} primitives"
    return growth, basis
