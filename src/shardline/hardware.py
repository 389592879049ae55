"""The hardware catalogue: every fact about an accelerator, in one place, found by one matching rule.

Like XPK's `system_characteristics`: one frozen record per accelerator. The planner (memory), the MFU and
plan-time peaks (model/flops.py), the price table (planning/cost.py), `shardline gpucheck` and the network profiles
(network_profiles.py) all resolve a device through `match_device`, so they cannot disagree about what a GPU is.

Peaks are *dense* tensor-core TFLOP/s from NVIDIA's datasheets: the datasheets print the 2:4-sparsity figure
with an asterisk; the dense figure is half of it. `fp32_tflops` is TF32 (what fp32 matmuls run as on
Ampere and later; the FP32 CUDA-core figure on a GPU without TF32). `memory_mib` is the total that
`nvidia-smi --query-gpu=name,memory.total` reports (what the CUDA allocator can ever use), not the marketing GB.

This module is the bottom layer: it imports nothing from shardline.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

FLOAT8_DIM_MULTIPLE = 16
"""Both dimensions of a float8 matmul's weight must be multiples of this (`torch._scaled_mm` on FP8 tensor cores)."""

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
# Accelerators without prices here are priced by the spec: `cost.prices` or `cost.usd_per_device_hour`.
PRICES_AS_OF = "2025-06, GCP us-central1 list prices (approximate)"


@dataclass(frozen=True)
class Prices:
    """US dollars per device-hour under each provisioning model (`PROVISIONING`)."""

    on_demand: float
    spot: float
    dws_flex_start: float
    reservation: float

    def row(self) -> dict[str, float]:
        return dict(zip(PROVISIONING, (self.on_demand, self.spot, self.dws_flex_start, self.reservation), strict=True))


@dataclass(frozen=True)
class Accelerator:
    key: str
    """Canonical key: `shardline plan --device`, `cost.gpu`, the rows of `cost.prices`."""
    name: str
    """Display name (the planner's device label)."""
    patterns: tuple[tuple[str, ...], ...]
    """Token sets, any of which identifies this accelerator in a device name (see `match_device`)."""
    memory_mib: int
    bf16_tflops: float | None
    fp32_tflops: float
    fp8_tflops: float | None
    hbm_gbps: float
    """Device-memory bandwidth, GB/s."""
    interconnect: str
    """GPU-to-GPU link inside a node."""
    prices: Prices | None = None
    kind: Literal["gpu", "tpu"] = "gpu"

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * 2**20

    @property
    def memory_gib(self) -> float:
        return self.memory_mib / 1024


# Columns: key, name, patterns, memory MiB, dense bf16 / tf32 / fp8 TFLOP/s, HBM GB/s, interconnect, prices.
# Dense = the datasheet's sparsity figure (marked * below) ÷ 2; H100/H200 989, H100 PCIe 756 and H100 NVL 835
# are those halves rounded down, as the project has always quoted them.
GPUS: tuple[Accelerator, ...] = (
    # H100 datasheet (SXM / PCIe / NVL columns): BF16 1,979 / 1,513 / 1,671*, TF32 989 / 756 / 835*,
    # FP8 3,958 / 3,026 / 3,341* (* with sparsity); HBM3 3.35 TB/s, HBM2e 2 TB/s, HBM3 3.9 TB/s.
    # nvidia-smi: "NVIDIA H100 80GB HBM3" 81559 MiB, "NVIDIA H100 PCIe" 81559 MiB, "NVIDIA H100 NVL" 95830 MiB.
    Accelerator("h100", "H100 80GB", (("h100",),), 81_559, 989.0, 494.5, 1979.0, 3350.0,
                "NVLink 4, 900 GB/s", Prices(11.06, 3.72, 5.53, 7.74)),
    Accelerator("h100-pcie", "H100 PCIe 80GB", (("h100", "pcie"),), 81_559, 756.0, 378.0, 1513.0, 2000.0,
                "PCIe Gen5 x16, 128 GB/s (NVLink bridge 600 GB/s)"),
    Accelerator("h100-nvl", "H100 NVL 94GB", (("h100", "nvl"),), 95_830, 835.0, 417.5, 1670.5, 3900.0,
                "NVLink bridge 600 GB/s, PCIe Gen5 x16"),
    # H200 datasheet (SXM / NVL): BF16 1,979 / 1,671*, TF32 989 / 835*, FP8 3,958 / 3,341*; HBM3e 4.8 TB/s.
    # nvidia-smi: "NVIDIA H200" and "NVIDIA H200 NVL", both 143771 MiB.
    Accelerator("h200", "H200 141GB", (("h200",),), 143_771, 989.0, 494.5, 1979.0, 4800.0,
                "NVLink 4, 900 GB/s", Prices(10.85, 3.72, 5.43, 7.60)),
    Accelerator("h200-nvl", "H200 NVL 141GB", (("h200", "nvl"),), 143_771, 835.5, 417.5, 1670.5, 4800.0,
                "NVLink bridge 900 GB/s, PCIe Gen5 x16"),
    # HGX B200 datasheet, 8 GPUs: FP16/BF16 36 PFLOPS*, TF32 18 PFLOPS*, FP8 72 PFLOPS*; HBM3e 8 TB/s per GPU.
    # B300: kept at the B200's figures, as the project had it (not re-checked against an HGX B300 datasheet).
    # GB200 NVL72 datasheet, 72 GPUs: FP16/BF16 360 PFLOPS*, TF32 180 PFLOPS*, FP8 720 PFLOPS*; HBM3e 8 TB/s.
    # nvidia-smi: "NVIDIA B200" 183359 MiB, "NVIDIA B300 SXM6 AC" 275040 MiB, "NVIDIA GB200" 189471 MiB.
    Accelerator("b200", "B200 180GB", (("b200",),), 183_359, 2250.0, 1125.0, 4500.0, 8000.0,
                "NVLink 5, 1.8 TB/s", Prices(14.27, 5.10, 7.14, 9.99)),
    Accelerator("b300", "B300 288GB", (("b300",),), 275_040, 2250.0, 1125.0, 4500.0, 8000.0,
                "NVLink 5, 1.8 TB/s"),
    Accelerator("gb200", "GB200 186GB", (("gb200",),), 189_471, 2500.0, 1250.0, 5000.0, 8000.0,
                "NVLink 5, 1.8 TB/s"),
    # A100 datasheet: BF16 312, TF32 156 (dense; no FP8); HBM2e 2,039 GB/s (80GB SXM), HBM2 1,555 GB/s (40GB).
    # nvidia-smi: "NVIDIA A100-SXM4-80GB" / "NVIDIA A100 80GB PCIe" 81920 MiB, "NVIDIA A100-SXM4-40GB" /
    # "NVIDIA A100-PCIE-40GB" 40960 MiB. GKE's "nvidia-tesla-a100" is the 40GB part.
    Accelerator("a100", "A100 80GB", (("a100",),), 81_920, 312.0, 156.0, None, 2039.0,
                "NVLink 3, 600 GB/s", Prices(5.07, 1.57, 2.54, 3.19)),
    Accelerator("a100-40gb", "A100 40GB", (("a100", "40gb"), ("tesla", "a100")), 40_960, 312.0, 156.0, None,
                1555.0, "NVLink 3, 600 GB/s"),
    # L40S datasheet: BF16 362.05 / 733*, TF32 183 / 366*, FP8 733 / 1,466*; 48 GB GDDR6, 864 GB/s.
    # nvidia-smi: "NVIDIA L40S" 46068 MiB.
    Accelerator("l40s", "L40S 48GB", (("l40s",),), 46_068, 362.0, 183.0, 733.0, 864.0, "PCIe Gen4 x16, 64 GB/s"),
    # L4 datasheet: BF16 242*, TF32 120*, FP8 485*; GDDR6 300 GB/s. nvidia-smi: "NVIDIA L4" 23034 MiB.
    Accelerator("l4", "L4 24GB", (("l4",),), 23_034, 121.0, 60.0, 242.5, 300.0, "PCIe Gen4 x16, 64 GB/s",
                Prices(0.85, 0.31, 0.43, 0.54)),
    # A10G (AWS G5 only): NVIDIA publishes no datasheet for it; AWS's G5 figures as Baseten's "NVIDIA A10 vs A10G"
    # spec sheet tabulates them: BF16 tensor 70, TF32 35 (dense; the A10 datasheet's are 125 / 62.5), 24 GB GDDR6
    # 600 GB/s. nvidia-smi: "NVIDIA A10G" 23028 MiB.
    Accelerator("a10g", "A10G 24GB", (("a10g",),), 23_028, 70.0, 35.0, None, 600.0, "PCIe Gen4 x16, 64 GB/s"),
    # GeForce cards (consumer: no NVLink; their tensor cores run fp16/bf16 with FP32 accumulate at half the fp16-
    # accumulate rate, and that half is the training figure). NVIDIA Ada GPU architecture whitepaper, appendix
    # table (RTX 4090): "Peak BF16 Tensor TFLOPS with FP32 Accumulate" 165.2 / 330.4*, TF32 82.6 / 165.2*, FP8 with
    # FP32 accumulate 330.3 / 660.6*; 24 GB GDDR6X, 1,008 GB/s. nvidia-smi: "NVIDIA GeForce RTX 4090" 24564 MiB.
    Accelerator("rtx4090", "RTX 4090 24GB", (("rtx4090",), ("rtx", "4090")), 24_564, 165.2, 82.6, 330.3, 1008.0,
                "PCIe Gen4 x16, 64 GB/s (no NVLink)"),
    # NVIDIA Ampere GA102 GPU architecture whitepaper, appendix table (RTX 3090): "Peak BF16 Tensor TFLOPS with
    # FP32 Accumulate" 71 / 142*, TF32 35.6 / 71*; no FP8; 24 GB GDDR6X, 936 GB/s.
    # nvidia-smi: "NVIDIA GeForce RTX 3090" 24576 MiB.
    Accelerator("rtx3090", "RTX 3090 24GB", (("rtx3090",), ("rtx", "3090")), 24_576, 71.0, 35.6, None, 936.0,
                "PCIe Gen4 x16, 64 GB/s (NVLink bridge 112.5 GB/s)"),
    # T4 datasheet: FP16 65 (dense), FP32 8.1; no BF16 or TF32 tensor cores (bf16 is emulated: no peak);
    # GDDR6 320 GB/s. nvidia-smi: "Tesla T4" 15360 MiB.
    Accelerator("t4", "T4 16GB", (("t4",),), 15_360, None, 8.1, None, 320.0, "PCIe Gen3 x16, 32 GB/s"),
    # V100 datasheet (SXM2 32GB): FP16 tensor 125 (dense), FP32 15.7; no BF16 or TF32 tensor cores (bf16 is
    # emulated: no peak); HBM2 900 GB/s. nvidia-smi: "Tesla V100-SXM2-32GB" 32768 MiB (the 16GB part: 16384).
    Accelerator("v100", "V100 32GB", (("v100",),), 32_768, None, 15.7, None, 900.0, "NVLink 2, 300 GB/s"),
    Accelerator("v100-16gb", "V100 16GB", (("v100", "16gb"),), 16_384, None, 15.7, None, 900.0,
                "NVLink 2, 300 GB/s"),
)

# TPUs (kind="tpu"): one device is one chip. Figures from Google Cloud's public TPU pages (cloud.google.com/tpu/docs/
# v5e, /v5p, /v6e: "Peak compute per chip (bf16)", "HBM2 capacity/bandwidth per chip"); memory_mib is the HBM per
# chip in GiB × 1024 as the pages give it (v5p's "95 GB" taken as 95 GiB; not measured: no TPU here). fp32 matmuls
# run as bf16 passes on the MXU: no separate fp32 peak is published, the bf16 figure stands in.
# $/chip-hour: cloud.google.com/tpu/pricing (us-central1, approximate, 2025-06, not re-checked): on-demand v5e 1.20,
# v5p 4.20, v6e 2.70; spot (cloud.google.com/spot-vms/pricing, TPU rows; moves daily) v5e 0.60, v5p 2.10, v6e 1.35;
# DWS flex-start is priced like spot for TPUs there; reservation: the 1-year committed-use price (v5e 0.84,
# v5p 2.94, v6e 1.89).
# Patterns: the catalogue key, JAX's device_kind ("TPU v5 lite", "TPU v5", "TPU v6 lite") and GKE's
# cloud.google.com/gke-tpu-accelerator value (tpu-v5-lite-podslice, tpu-v5p-slice, tpu-v6e-slice). v5e comes first:
# "TPU v5 lite" also holds v5p's ("tpu", "v5"), and the first of equally long matches wins.
TPUS: tuple[Accelerator, ...] = (
    Accelerator("v5e", "TPU v5e 16GB", (("v5e",), ("v5", "lite")), 16_384, 197.0, 197.0, None, 819.0,
                "ICI 1,600 Gbps per chip, 2D torus", Prices(1.20, 0.60, 0.60, 0.84), kind="tpu"),
    Accelerator("v5p", "TPU v5p 95GB", (("v5p",), ("tpu", "v5")), 97_280, 459.0, 459.0, None, 2765.0,
                "ICI 4,800 Gbps per chip, 3D torus", Prices(4.20, 2.10, 2.10, 2.94), kind="tpu"),
    Accelerator("v6e", "TPU v6e 32GB", (("v6e",), ("v6", "lite"), ("trillium",)), 32_768, 918.0, 918.0, None, 1640.0,
                "ICI 3,584 Gbps per chip, 2D torus", Prices(2.70, 1.35, 1.35, 1.89), kind="tpu"),
)


@dataclass(frozen=True)
class TpuGeneration:
    """What GKE and the TPU VM need to know of a generation: its node label, machine types and topology rank."""

    key: str
    gke_accelerator: str
    """cloud.google.com/gke-tpu-accelerator (GKE "Plan TPUs in GKE": tpu-v5-lite-podslice, tpu-v5p-slice,
    tpu-v6e-slice)."""
    machine_prefix: str
    """Multi-host node machine type without the chip count: ct5lp-hightpu-, ct5p-hightpu-, ct6e-standard-."""
    dims: int
    """Topology rank: 2 (v5e, v6e: AxB) or 3 (v5p: AxBxC)."""
    max_chips: int
    """Largest slice (v5e 256, v5p 8,960, v6e 256)."""
    ray_pod_type: str
    """Cloud TPU's (and Ray's) accelerator type of a slice: v5e counts chips as `v5litepod-N`, v5p TensorCores (2 per
    chip), v6e chips; Ray names host 0 of a slice `TPU-<this>-head`."""


TPU_GENERATIONS = {g.key: g for g in (
    TpuGeneration("v5e", "tpu-v5-lite-podslice", "ct5lp-hightpu-", 2, 256, "v5litepod-{chips}"),
    TpuGeneration("v5p", "tpu-v5p-slice", "ct5p-hightpu-", 3, 8960, "v5p-{cores}"),
    TpuGeneration("v6e", "tpu-v6e-slice", "ct6e-standard-", 2, 256, "v6e-{chips}"),
)}
CHIPS_PER_HOST = 4
"""Multi-host slices have 4 chips per TPU VM (ct5lp-hightpu-4t, ct5p-hightpu-4t, ct6e-standard-4t); a v5e/v6e slice
of at most 8 chips is one VM with all of them (…-1t, -4t, -8t), and v5p's smallest slice, 2x2x1, one 4-chip VM."""


@dataclass(frozen=True)
class TpuSlice:
    accelerator: Accelerator
    generation: TpuGeneration
    topology: str
    chips: int
    hosts: int

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts

    @property
    def machine_type(self) -> str:
        return f"{self.generation.machine_prefix}{self.chips_per_host}t"


def tpu_slice(key: str, topology: str) -> TpuSlice:
    """Chips and hosts of one slice of `key` (v5e, v5p, v6e) in `topology` ("4x4", "2x2x4"); ValueError names what
    is wrong (the spec layer turns it into a SpecError with the field)."""
    gen = TPU_GENERATIONS.get(key)
    if gen is None:
        raise ValueError(f"unknown TPU type {key!r}; known: {', '.join(TPU_GENERATIONS)}")
    parts = topology.lower().split("x")
    if len(parts) != gen.dims or not all(p.isdigit() and int(p) > 0 for p in parts):
        example = "4x4" if gen.dims == 2 else "2x2x4"
        raise ValueError(f"{topology!r} is not a {gen.dims}-D {key} topology (e.g. {example})")
    chips = 1
    for p in parts:
        chips *= int(p)
    if chips > gen.max_chips:
        raise ValueError(f"{topology} has {chips} chips, more than a {key} slice holds ({gen.max_chips})")
    single_host = chips <= (8 if gen.dims == 2 else CHIPS_PER_HOST)
    hosts = 1 if single_host else chips // CHIPS_PER_HOST
    acc = next(a for a in TPUS if a.key == key)
    return TpuSlice(acc, gen, topology.lower(), chips, hosts)

ACCELERATORS: tuple[Accelerator, ...] = GPUS + TPUS


def price_table(overrides: Mapping[str, Mapping[str, float]] | None = None) -> dict[str, dict[str, float]]:
    """$/device-hour per accelerator key and provisioning model: the catalogue's prices with `overrides`
    (the spec's `cost.prices`) merged over them."""
    table = {gpu.key: gpu.prices.row() for gpu in ACCELERATORS if gpu.prices is not None}
    for gpu, row in (overrides or {}).items():
        table.setdefault(gpu.lower(), {}).update(row)
    return table


def tokens(name: str) -> frozenset[str]:
    """The lower-case alphanumeric words of a name: 'NVIDIA A100-SXM4-40GB' → {nvidia, a100, sxm4, 40gb}."""
    return frozenset(re.findall(r"[a-z0-9]+", name.lower()))


def match_device(name: str) -> Accelerator | None:
    """The catalogue entry of a device name — as CUDA/`nvidia-smi` report it ('NVIDIA H100 80GB HBM3'), a
    catalogue key ('h100'), a display name or a GKE accelerator label ('nvidia-h100-80gb') — or None.

    A pattern matches when all its tokens are whole words of the name, so an L40S is never an L4; the entry
    with the longest matching pattern wins, so 'NVIDIA H100 PCIe' is the PCIe card, not the SXM one."""
    words = tokens(name)
    best, best_len = None, 0
    for acc in ACCELERATORS:
        for pattern in acc.patterns:
            if len(pattern) > best_len and words.issuperset(pattern):
                best, best_len = acc, len(pattern)
    return best
