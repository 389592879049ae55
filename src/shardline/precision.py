"""`train.precision: auto`: bf16 where the hardware multiplies bf16 natively, fp32 where bf16 would be emulated.

GPUs and TPUs multiply bf16 natively. A CPU does when it has AMX or AVX512_BF16 (x86) or the BF16 extension
(Arm); without them torch emulates bf16 matmul, which measured ~13× slower than fp32 on an AVX2-only CPU (and
bf16 matmul ≥4× fp32 with AMX). The choice is read from the CPU's flags, not guessed, and is made once, where
the run is created, so a resume keeps it (the run's spec.yaml holds the chosen value).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

X86_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""/proc/cpuinfo `flags` that mean native bf16 matrix arithmetic on x86."""
ARM_BF16_FEATURE = "bf16"
"""/proc/cpuinfo `Features` entry of Arm's BF16 extension."""
EMULATED_SLOWDOWN = "~13× slower than fp32 (measured on an AVX2-only CPU)"


@dataclass(frozen=True)
class PrecisionChoice:
    precision: str
    """bf16 or fp32."""
    reason: str


def cpu_bf16_feature(cpuinfo: str | None = None) -> str | None:
    """The CPU feature that gives native bf16 matmul (`amx_bf16`, `avx512_bf16`, Arm `bf16`), or None."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        words = set(value.split())
        if key.strip() == "flags":
            return next((flag for flag in X86_BF16_FLAGS if flag in words), None)
        if key.strip() == "Features":
            return ARM_BF16_FEATURE if ARM_BF16_FEATURE in words else None
    return None


def choose_precision(requested: str, accelerator: bool, cpuinfo: str | None = None,
                     native_bf16: bool = True) -> PrecisionChoice:
    """The precision a run uses: `requested` unless it is `auto`; `accelerator` when it runs on a GPU or TPU, and
    `native_bf16` whether that accelerator has bf16 tensor cores (T4 and V100 have none: bf16 is emulated there)."""
    if requested != "auto":
        return PrecisionChoice(requested, "train.precision in the spec")
    if accelerator and not native_bf16:
        return PrecisionChoice("fp32", "auto: this GPU has no bf16 tensor cores (compute capability below 8.0, "
                               "e.g. T4, V100), where bf16 is emulated")
    if accelerator:
        return PrecisionChoice("bf16", "auto: the accelerator multiplies bf16 natively")
    if feature := cpu_bf16_feature(cpuinfo):
        return PrecisionChoice("bf16", f"auto: this CPU multiplies bf16 natively ({feature})")
    return PrecisionChoice("fp32", "auto: this CPU has no native bf16 matmul (no AMX, AVX512_BF16 or Arm BF16), "
                           f"where bf16 is emulated, {EMULATED_SLOWDOWN}")


def emulated_bf16_warning(requested: str, accelerator: bool, cpuinfo: str | None = None) -> str | None:
    """A one-line warning when the spec asks for bf16 on a CPU that would emulate it, else None."""
    if requested != "bf16" or accelerator or cpu_bf16_feature(cpuinfo):
        return None
    return (f"warning: train.precision=bf16 on a CPU without native bf16 matmul: emulated, {EMULATED_SLOWDOWN}; "
            "train.precision=auto or fp32 is faster here")


def cuda_native_bf16() -> bool:
    """Whether this process's CUDA GPU has bf16 tensor cores (torch's check without emulation)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
