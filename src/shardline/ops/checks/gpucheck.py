"""GPU health before an expensive run: NVML readings, a bf16 matmul burn-in, device-memory bandwidth, stragglers.

Each rank checks its own device: the NVML readings of that GPU (ECC, retired/remapped pages, temperature
and throttle reasons, clocks, power, PCIe link, NVLink), the bf16 matmul TFLOP/s against the device's
dense peak and the copy bandwidth of device memory against its HBM bandwidth (both from hardware.py, the
one catalogue; only the peak is a pass/fail check, copies reach well under the HBM figure). Rank 0 gathers
every rank's result and flags stragglers: ranks slower than the median by more than
`launch.gpucheck.straggler_threshold` (one slow GPU sets the pace of every synchronous step).

NVML is read through `NvmlReader`, a small interface: `PynvmlReader` talks to the driver through
`nvidia-ml-py`; tests replay recorded readings.

Exit codes: 0 every check passed; 1 a check failed (a finding of severity "fail", a device under
`min_peak_fraction` of its peak, a straggler); 3 (`EXIT_NO_GPU`) no CUDA device — the CPU matmul probe
and memory bandwidth are still measured and reported, so the command says what this machine can do.
"""

from __future__ import annotations

import socket
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Literal, Protocol

import torch

from shardline.errors import EXIT_FAILURE, EXIT_OK
from shardline.hardware import match_device
from shardline.model.flops import probe_matmul_tflops
from shardline.spec import JobSpec

EXIT_NO_GPU = 3

# NVML clock-event ("throttle") reason bits (nvml.h, nvmlClocksEventReason*): stable ABI values.
THROTTLE_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
FAILING_THROTTLES = {"hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}
TEMPERATURE_MARGIN_C = 5
"""Warn when the GPU is this close to its slowdown temperature."""


@dataclass(frozen=True)
class GpuReading:
    """One device as NVML reports it; None where the device or driver does not support a query."""

    index: int
    name: str
    uuid: str
    pci_bus_id: str | None = None
    ecc_volatile_uncorrected: int | None = None
    ecc_volatile_corrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None
    ecc_aggregate_corrected: int | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    temperature_c: int | None = None
    slowdown_temperature_c: int | None = None
    throttle_reasons: int | None = None
    sm_clock_mhz: int | None = None
    max_sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    pcie_gen: int | None = None
    pcie_max_gen: int | None = None
    pcie_width: int | None = None
    pcie_max_width: int | None = None
    nvlink_active: int | None = None
    nvlink_total: int | None = None
    """Links that exist on this device (NVML answers for them); 0 on PCIe-only GPUs."""

    def throttle_names(self) -> list[str]:
        bits = self.throttle_reasons or 0
        return [name for bit, name in THROTTLE_REASONS.items() if bits & bit]


class NvmlReader(Protocol):
    def driver_version(self) -> str: ...

    def readings(self) -> list[GpuReading]:
        """Every GPU NVML sees on this host, in NVML index order."""


class NvmlUnavailable(Exception):
    """NVML cannot be used here (library or driver missing); the message says why."""


class PynvmlReader:
    """NVML through `nvidia-ml-py` (module `pynvml`)."""

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as e:
            raise NvmlUnavailable("nvidia-ml-py is not installed (pip install 'shardline[gpu]')") from e
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise NvmlUnavailable(f"NVML: {e}") from e
        self.nvml = pynvml

    def driver_version(self) -> str:
        v = self.nvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)

    def _get(self, fn, *args):
        try:
            return fn(*args)
        except self.nvml.NVMLError:  # not supported on this device/driver (or a transient query failure)
            return None

    def _read(self, index: int) -> GpuReading:
        n, get = self.nvml, self._get
        h = n.nvmlDeviceGetHandleByIndex(index)
        name, uuid = n.nvmlDeviceGetName(h), n.nvmlDeviceGetUUID(h)
        pci = get(n.nvmlDeviceGetPciInfo, h)
        bus = getattr(pci, "busId", None) if pci is not None else None
        ecc = {(err, kind): get(n.nvmlDeviceGetTotalEccErrors, h, err, kind)
               for err in (n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_MEMORY_ERROR_TYPE_CORRECTED)
               for kind in (n.NVML_VOLATILE_ECC, n.NVML_AGGREGATE_ECC)}
        sbe = get(n.nvmlDeviceGetRetiredPages, h, n.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
        dbe = get(n.nvmlDeviceGetRetiredPages, h, n.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        pending = get(n.nvmlDeviceGetRetiredPagesPendingStatus, h)
        remap = get(n.nvmlDeviceGetRemappedRows, h)
        # renamed in NVML 12.2 ("clock events"); older nvidia-ml-py only has the throttle name
        event_reasons = (getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None)
                         or n.nvmlDeviceGetCurrentClocksThrottleReasons)
        reasons = get(event_reasons, h)
        power, limit = get(n.nvmlDeviceGetPowerUsage, h), get(n.nvmlDeviceGetEnforcedPowerLimit, h)
        links = [get(n.nvmlDeviceGetNvLinkState, h, i) for i in range(n.NVML_NVLINK_MAX_LINKS)]
        existing = [s for s in links if s is not None]
        U, C, V, A = (n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_VOLATILE_ECC,
                      n.NVML_AGGREGATE_ECC)
        return GpuReading(
            index=index, name=name.decode() if isinstance(name, bytes) else name,
            uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
            pci_bus_id=bus.decode() if isinstance(bus, bytes) else bus,
            ecc_volatile_uncorrected=ecc[U, V], ecc_volatile_corrected=ecc[C, V],
            ecc_aggregate_uncorrected=ecc[U, A], ecc_aggregate_corrected=ecc[C, A],
            retired_pages_sbe=None if sbe is None else len(sbe), retired_pages_dbe=None if dbe is None else len(dbe),
            retired_pages_pending=None if pending is None else pending == n.NVML_FEATURE_ENABLED,
            remapped_rows_correctable=None if remap is None else remap[0],
            remapped_rows_uncorrectable=None if remap is None else remap[1],
            remap_pending=None if remap is None else bool(remap[2]),
            remap_failure=None if remap is None else bool(remap[3]),
            temperature_c=get(n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU),
            slowdown_temperature_c=get(n.nvmlDeviceGetTemperatureThreshold, h, n.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
            throttle_reasons=reasons,
            sm_clock_mhz=get(n.nvmlDeviceGetClockInfo, h, n.NVML_CLOCK_SM),
            max_sm_clock_mhz=get(n.nvmlDeviceGetMaxClockInfo, h, n.NVML_CLOCK_SM),
            mem_clock_mhz=get(n.nvmlDeviceGetClockInfo, h, n.NVML_CLOCK_MEM),
            power_w=None if power is None else power / 1000, power_limit_w=None if limit is None else limit / 1000,
            pcie_gen=get(n.nvmlDeviceGetCurrPcieLinkGeneration, h),
            pcie_max_gen=get(n.nvmlDeviceGetMaxPcieLinkGeneration, h),
            pcie_width=get(n.nvmlDeviceGetCurrPcieLinkWidth, h),
            pcie_max_width=get(n.nvmlDeviceGetMaxPcieLinkWidth, h),
            nvlink_active=sum(1 for s in existing if s == n.NVML_FEATURE_ENABLED), nvlink_total=len(existing))

    def readings(self) -> list[GpuReading]:
        return [self._read(i) for i in range(self.nvml.nvmlDeviceGetCount())]


Severity = Literal["fail", "warn"]


@dataclass(frozen=True)
class Finding:
    severity: Severity
    check: str
    detail: str


def assess(r: GpuReading) -> list[Finding]:
    """What in one device's readings makes it unfit (fail) or worth a look (warn)."""
    out: list[Finding] = []

    def add(cond, severity: Severity, check: str, detail: str) -> None:
        if cond:
            out.append(Finding(severity, check, detail))

    add(r.ecc_volatile_uncorrected, "fail", "ecc", f"{r.ecc_volatile_uncorrected} uncorrectable ECC errors since "
        "the last driver load: drain the node and reset the GPU")
    add(r.ecc_aggregate_uncorrected, "warn", "ecc", f"{r.ecc_aggregate_uncorrected} uncorrectable ECC errors over "
        "the GPU's lifetime")
    add(r.retired_pages_dbe, "fail", "retired_pages", f"{r.retired_pages_dbe} pages retired for double-bit errors")
    add(r.retired_pages_pending, "fail", "retired_pages", "page retirement pending: reset the GPU")
    add(r.remap_failure, "fail", "remapped_rows", "row remapping failed: the GPU needs replacing")
    add(r.remap_pending, "fail", "remapped_rows", "row remapping pending: reset the GPU")
    add(r.remapped_rows_uncorrectable, "warn", "remapped_rows",
        f"{r.remapped_rows_uncorrectable} rows remapped for uncorrectable errors")
    bad = [name for name in r.throttle_names() if name in FAILING_THROTTLES]
    add(bad, "fail", "throttle", f"clocks held down by {', '.join(bad)}")
    add("sw_power_cap" in r.throttle_names(), "warn", "throttle", "clocks limited by the software power cap")
    if r.temperature_c is not None and r.slowdown_temperature_c:
        add(r.temperature_c >= r.slowdown_temperature_c - TEMPERATURE_MARGIN_C, "warn", "temperature",
            f"{r.temperature_c} °C, slowdown at {r.slowdown_temperature_c} °C")
    if r.pcie_width is not None and r.pcie_max_width:
        add(r.pcie_width < r.pcie_max_width, "warn", "pcie",
            f"PCIe link x{r.pcie_width} of x{r.pcie_max_width} (degraded link or riser)")
    if r.nvlink_total:
        add((r.nvlink_active or 0) < r.nvlink_total, "fail", "nvlink",
            f"{r.nvlink_active}/{r.nvlink_total} NVLinks active")
    return out


def memory_bandwidth_gbps(device: torch.device, seconds: float, nbytes: int) -> float:
    """Device-to-device copy bandwidth: each copy reads and writes nbytes (counted twice, as STREAM does)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    sync(device)
    iters, start = 0, time.perf_counter()
    while True:
        dst.copy_(src)
        iters += 1
        sync(device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and iters >= 3:
            return 2 * nbytes * iters / elapsed / 1e9


def stragglers(values: dict[int, float], threshold: float) -> list[int]:
    """Ranks whose value (higher is better) is below the median by more than `threshold` (a fraction)."""
    if len(values) < 2:
        return []
    median = statistics.median(values.values())
    return sorted(rank for rank, v in values.items() if v < median * (1 - threshold))


@dataclass
class RankResult:
    rank: int
    host: str
    device: str
    """GPU name, or "cpu"."""
    matmul_tflops: float
    matmul_dtype: str
    peak_tflops: float | None
    memory_gbps: float
    reading: dict | None = None
    findings: list[dict] = field(default_factory=list)
    nvml_error: str | None = None
    driver_version: str | None = None
    peak_memory_gbps: float | None = None

    @property
    def peak_fraction(self) -> float | None:
        return self.matmul_tflops / self.peak_tflops if self.peak_tflops else None

    @property
    def memory_fraction(self) -> float | None:
        return self.memory_gbps / self.peak_memory_gbps if self.peak_memory_gbps else None


def expected_peaks(device_name: str) -> tuple[float | None, float | None]:
    """What a healthy GPU of this name reaches at most: dense bf16 TFLOP/s and memory GB/s (None: not catalogued)."""
    gpu = match_device(device_name)
    return (None, None) if gpu is None else (gpu.bf16_tflops, gpu.hbm_gbps)


def own_reading(readings: list[GpuReading], device_uuid: str | None, local_index: int) -> GpuReading | None:
    """The reading of the GPU this rank drives: matched by UUID (CUDA_VISIBLE_DEVICES may renumber), else index."""
    if device_uuid:
        for r in readings:
            if r.uuid.removeprefix("GPU-") == device_uuid.removeprefix("GPU-"):
                return r
    return readings[local_index] if local_index < len(readings) else None


def check_rank(spec: JobSpec, rank: int, device: torch.device, reader_factory=PynvmlReader) -> RankResult:
    """This rank's device: NVML readings and findings (GPU only), matmul burn-in, memory bandwidth."""
    seconds = spec.launch.gpucheck.seconds
    if device.type != "cuda":
        dtype = torch.bfloat16
        tflops = probe_matmul_tflops(dtype, device, n=1024, seconds=seconds)
        return RankResult(rank, socket.gethostname(), "cpu", tflops, "bfloat16", None,
                          memory_bandwidth_gbps(device, seconds, 256 << 20))
    name = torch.cuda.get_device_name(device)
    peak_tflops, peak_gbps = expected_peaks(name)
    result = RankResult(rank, socket.gethostname(), name,
                        probe_matmul_tflops(torch.bfloat16, device, n=8192, seconds=seconds), "bfloat16",
                        peak_tflops, memory_bandwidth_gbps(device, seconds, 1 << 30), peak_memory_gbps=peak_gbps)
    try:
        reader = reader_factory()
    except NvmlUnavailable as e:
        result.nvml_error = str(e)
        result.findings.append(asdict(Finding("warn", "nvml", f"no health readings: {e}")))
        return result
    result.driver_version = reader.driver_version()
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    reading = own_reading(reader.readings(), str(uuid) if uuid else None, device.index or 0)
    if reading is None:
        result.findings.append(asdict(Finding("warn", "nvml", "NVML does not list this rank's GPU")))
        return result
    result.reading = asdict(reading)
    result.findings += [asdict(f) for f in assess(reading)]
    return result


@dataclass(frozen=True)
class Summary:
    gpu: bool
    passed: bool
    stragglers: list[int]
    reasons: list[str]


def summarize(results: list[RankResult], spec: JobSpec) -> Summary:
    cfg = spec.launch.gpucheck
    gpu = all(r.device != "cpu" for r in results)
    reasons = [f"rank {r.rank} ({r.host}): {f['check']}: {f['detail']}" for r in results for f in r.findings
               if f["severity"] == "fail"]
    for r in results:
        if r.peak_fraction is not None and r.peak_fraction < cfg.min_peak_fraction:
            reasons.append(f"rank {r.rank} ({r.host}): bf16 matmul {r.matmul_tflops:.0f} TFLOP/s is "
                           f"{r.peak_fraction:.0%} of the {r.device} peak {r.peak_tflops:.0f} "
                           f"(< {cfg.min_peak_fraction:.0%})")
    slow = sorted(set(stragglers({r.rank: r.matmul_tflops for r in results}, cfg.straggler_threshold))
                  | set(stragglers({r.rank: r.memory_gbps for r in results}, cfg.straggler_threshold)))
    for rank in slow:
        reasons.append(f"rank {rank} is a straggler: more than {cfg.straggler_threshold:.0%} below the median "
                       "matmul or memory bandwidth")
    return Summary(gpu, not reasons, slow, reasons)


def exit_code(summary: Summary) -> int:
    if not summary.gpu:
        return EXIT_NO_GPU
    return EXIT_OK if summary.passed else EXIT_FAILURE


def result_document(results: list[RankResult], summary: Summary) -> dict:
    return {"kind": "gpucheck", "gpu": summary.gpu, "passed": summary.passed,
            "stragglers": summary.stragglers, "reasons": summary.reasons,
            "ranks": [asdict(r) | {"peak_fraction": r.peak_fraction, "memory_fraction": r.memory_fraction}
                      for r in results]}
