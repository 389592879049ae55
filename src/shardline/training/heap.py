"""CPU workers hand the glibc heap's free pages back to the OS every few steps.

A CPU worker's tensors come from plain malloc, tuned by `engines.torchrun.CPU_MALLOC_ENV` for speed: blocks under
1 MiB live in the heap, which is never trimmed. Their sizes vary step to step (document-length buckets, the last
loss chunk), so freed holes are not always reused and the heap's resident size creeps: the default run's rank held
0.92 GiB at step 200 and 1.41 GiB at step 900 (bench/RESULTS.md, 2026-11-27). Not a leak: with blocks from 64 KiB
up mmapped instead the same run stays at 0.94-0.96 GiB, at 1.5× the step time. `malloc_trim(0)` returns every free
page of the heap (not only its top) to the OS, keeping the fast layout; a trim every `TRIM_EVERY` steps costs a
few page faults per step after it. Every 10 steps rather than 50: the default run's peak after 150 steps 0.77 GiB
against 0.86 (every step: 0.72), median step 0.77 s against 0.79 (bench/RESULTS.md, 2026-11-27, sixteenth session).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

TRIM_EVERY = 10


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim this way
        return None


class HeapTrimmer:
    """`after_step(step)` trims the heap every `TRIM_EVERY` steps on a CPU worker with glibc; does nothing on a
    GPU worker (its tensors live in CUDA's caching allocator) or elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.trim = _malloc_trim() if device.type == "cpu" else None

    def after_step(self, step: int) -> None:
        if self.trim is not None and step % TRIM_EVERY == 0:
            self.trim(0)
