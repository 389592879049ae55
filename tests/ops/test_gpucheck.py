"""gpucheck: health findings from recorded NVML readings, the burn-in verdict, stragglers, and the no-GPU path."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from shardline.ops.checks import gpucheck
from shardline.ops.checks.gpucheck import (
    EXIT_NO_GPU,
    GpuReading,
    NvmlUnavailable,
    PynvmlReader,
    assess,
    check_rank,
    exit_code,
    expected_peaks,
    own_reading,
    stragglers,
    summarize,
)
from shardline.spec.resolve import load_spec, spec_to_yaml
from tests.conftest import REPO, run_cli
from tests.ops.nvml_recorded import RecordedReader


def _spec(*extra):
    return load_spec("tiny", ["launch.gpucheck.seconds=0.05", *extra])


def test_a_healthy_recorded_gpu_has_no_findings():
    healthy = RecordedReader(faulty=False).readings()
    assert [assess(r) for r in healthy] == [[]] * 8
    assert healthy[0].throttle_names() == ["gpu_idle"]


def test_recorded_faults_are_each_reported_with_the_right_severity():
    bad = RecordedReader().readings()[3]
    found = {(f.severity, f.check) for f in assess(bad)}
    assert found == {("fail", "ecc"), ("fail", "remapped_rows"), ("warn", "remapped_rows"), ("fail", "throttle"),
                     ("warn", "temperature"), ("warn", "pcie"), ("fail", "nvlink")}
    details = " | ".join(f.detail for f in assess(bad))
    assert "2 uncorrectable ECC errors" in details and "sw_thermal_slowdown, hw_thermal_slowdown" in details
    assert "PCIe link x8 of x16" in details and "17/18 NVLinks active" in details


def test_retired_pages_and_power_cap_on_pre_ampere_readings():
    v100 = GpuReading(index=0, name="Tesla V100", uuid="GPU-x", retired_pages_dbe=1, retired_pages_pending=True,
                      throttle_reasons=0x4, nvlink_total=0, nvlink_active=0)
    assert {(f.severity, f.check) for f in assess(v100)} == {("fail", "retired_pages"), ("warn", "throttle")}


def test_each_rank_picks_its_own_gpu_by_uuid_even_when_cuda_renumbers_devices():
    readings = RecordedReader().readings()
    assert own_reading(readings, "00000000-0000-0000-0000-000000000005", 0).index == 5
    assert own_reading(readings, None, 2).index == 2
    assert own_reading(readings, "unknown", 9) is None


def test_stragglers_are_ranks_below_the_median_by_more_than_the_threshold():
    assert stragglers({0: 700.0, 1: 690.0, 2: 710.0, 3: 600.0}, 0.1) == [3]   # median 695; 600 < 625.5
    assert stragglers({0: 700.0, 1: 640.0}, 0.1) == []                        # median 670; 640 ≥ 603
    assert stragglers({0: 700.0}, 0.1) == []


def _fake_cuda(monkeypatch, tflops_by_rank=None):
    """The GPU path on a CPU machine: an H100 named by torch, measurements replaced by numbers."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d=None: types.SimpleNamespace(uuid=f"00000000-0000-0000-0000-00000000000{d.index}"))
    tflops = tflops_by_rank or {}
    monkeypatch.setattr(gpucheck, "probe_matmul_tflops", lambda dtype, device, n, seconds: tflops.get(device.index,
                                                                                                         720.0))
    monkeypatch.setattr(gpucheck, "memory_bandwidth_gbps", lambda device, seconds, nbytes: 2900.0)


def test_gpu_ranks_with_recorded_nvml_fail_on_the_faulty_gpu_and_the_slow_one(monkeypatch):
    _fake_cuda(monkeypatch, {6: 400.0})
    spec = _spec()
    results = [check_rank(spec, i, torch.device("cuda", i), reader_factory=RecordedReader) for i in range(8)]
    assert results[0].reading["temperature_c"] == 34 and results[0].driver_version == "550.90.07"
    assert results[0].peak_tflops == 989.0 and results[0].peak_fraction == pytest.approx(720 / 989)
    assert results[0].memory_fraction == pytest.approx(2900 / expected_peaks("NVIDIA H100 80GB HBM3")[1])
    summary = summarize(results, spec)
    assert summary.gpu and not summary.passed and summary.stragglers == [6]
    text = "\n".join(summary.reasons)
    assert "rank 3" in text and "ecc" in text and "rank 6" in text and "40% of the NVIDIA H100" in text
    assert exit_code(summary) == 1
    _fake_cuda(monkeypatch)  # every GPU at 720 TFLOP/s, no faults
    healthy = [check_rank(spec, i, torch.device("cuda", i), lambda: RecordedReader(faulty=False)) for i in range(8)]
    assert exit_code(summarize(healthy, spec)) == 0


def test_gpu_without_nvml_still_burns_in_and_warns(monkeypatch):
    _fake_cuda(monkeypatch)

    def absent():
        raise NvmlUnavailable("nvidia-ml-py is not installed")

    result = check_rank(_spec(), 0, torch.device("cuda", 0), reader_factory=absent)
    assert result.reading is None and result.nvml_error == "nvidia-ml-py is not installed"
    assert result.findings[0]["severity"] == "warn" and result.matmul_tflops == 720.0
    assert summarize([result], _spec()).passed


def test_min_peak_fraction_and_straggler_threshold_come_from_the_spec(monkeypatch):
    _fake_cuda(monkeypatch, {1: 600.0})
    strict = _spec("launch.gpucheck.min_peak_fraction=0.8", "launch.gpucheck.straggler_threshold=0.5")
    results = [check_rank(strict, i, torch.device("cuda", i), lambda: RecordedReader(faulty=False)) for i in range(2)]
    summary = summarize(results, strict)
    assert summary.stragglers == [] and len(summary.reasons) == 2  # 720/989 = 73 % and 61 %, both under 80 %


def test_pynvml_reader_says_why_nvml_is_unavailable_without_a_driver(monkeypatch):
    broken = types.SimpleNamespace(NVMLError=RuntimeError)

    def init():
        raise RuntimeError("NVML Shared Library Not Found")

    broken.nvmlInit = init
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    with pytest.raises(NvmlUnavailable, match="Shared Library Not Found"):
        PynvmlReader()
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    with pytest.raises(NvmlUnavailable, match="pip install"):
        PynvmlReader()


def test_pynvml_reader_maps_every_nvml_query_onto_the_reading(monkeypatch):
    """Real pynvml constants, driver calls answered from a recorded reading: the adapter's wiring is right."""
    import pynvml  # nvidia-ml-py, in the test extra: a missing one fails here, it does not skip
    rec = RecordedReader().readings()[3]
    fake = types.SimpleNamespace(**{k: getattr(pynvml, k) for k in dir(pynvml) if k.startswith("NVML")})

    def unsupported(*a):
        raise pynvml.NVMLError_NotSupported()

    ecc = {(1, 0): rec.ecc_volatile_uncorrected, (0, 0): rec.ecc_volatile_corrected,
           (1, 1): rec.ecc_aggregate_uncorrected, (0, 1): rec.ecc_aggregate_corrected}
    fake.__dict__.update(
        nvmlInit=lambda: None, nvmlSystemGetDriverVersion=lambda: b"550.90.07", nvmlDeviceGetCount=lambda: 4,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetName=lambda h: rec.name.encode(),
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}", nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=b"0:3"),
        nvmlDeviceGetTotalEccErrors=lambda h, err, kind: ecc[err, kind],
        nvmlDeviceGetRetiredPages=unsupported, nvmlDeviceGetRetiredPagesPendingStatus=unsupported,
        nvmlDeviceGetRemappedRows=lambda h: (0, 1, 1, 0),
        nvmlDeviceGetTemperature=lambda h, s: 88, nvmlDeviceGetTemperatureThreshold=lambda h, t: 90,
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: 96,
        nvmlDeviceGetClockInfo=lambda h, c: {1: 1500, 2: 2619}[c], nvmlDeviceGetMaxClockInfo=lambda h, c: 1980,
        nvmlDeviceGetPowerUsage=lambda h: 650_000, nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000,
        nvmlDeviceGetCurrPcieLinkGeneration=lambda h: 5, nvmlDeviceGetMaxPcieLinkGeneration=lambda h: 5,
        nvmlDeviceGetCurrPcieLinkWidth=lambda h: 8, nvmlDeviceGetMaxPcieLinkWidth=lambda h: 16,
        nvmlDeviceGetNvLinkState=lambda h, i: (pynvml.NVML_FEATURE_ENABLED if i else 0) if i < 18 else unsupported(),
        NVMLError=pynvml.NVMLError)
    for name in ("nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetNvLinkState",
                 "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetEnforcedPowerLimit"):
        assert callable(getattr(pynvml, name))  # the functions the adapter calls exist in nvidia-ml-py
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    reader = PynvmlReader()
    got = reader.readings()[3]
    assert reader.driver_version() == "550.90.07" and len(reader.readings()) == 4
    assert (got.uuid, got.pci_bus_id, got.ecc_volatile_uncorrected, got.retired_pages_dbe) == ("GPU-3", "0:3", 2, None)
    assert (got.remap_pending, got.remapped_rows_uncorrectable, got.power_w, got.power_limit_w) == (True, 1, 650, 700)
    assert (got.pcie_width, got.nvlink_active, got.nvlink_total, got.sm_clock_mhz) == (8, 17, 18, 1500)
    assert {f.check for f in assess(got)} == {f.check for f in assess(rec)}


def test_cpu_rank_reports_the_matmul_probe_and_no_gpu():
    result = check_rank(_spec(), 0, torch.device("cpu"))
    assert result.device == "cpu" and result.matmul_tflops > 0 and result.memory_gbps > 0
    assert result.peak_tflops is None and result.reading is None
    summary = summarize([result], _spec())
    assert not summary.gpu and exit_code(summary) == EXIT_NO_GPU == 3


@pytest.mark.slow
def test_gpucheck_without_gpu_exits_3_from_the_cli_and_from_the_worker_task(tmp_path):
    out = tmp_path / "gpu.json"
    res = run_cli("gpucheck", "--seconds", "0.1", "--json", str(out), timeout=300)
    assert res.returncode == EXIT_NO_GPU, res.stdout[-3000:] + res.stderr[-3000:]
    assert "no GPU" in res.stdout and "bf16 TFLOP/s" in res.stdout
    doc = json.loads(out.read_text())
    assert doc["gpu"] is False and doc["ranks"][0]["device"] == "cpu" and doc["ranks"][0]["matmul_tflops"] > 0
    # the worker task every launcher runs (world of one here, no torchrun): result in the run directory
    spec = load_spec("tiny", [f"run.dir={tmp_path}", "run.id=gpu-1", "launch.gpucheck.seconds=0.1"])
    (tmp_path / "spec.yaml").write_text(spec_to_yaml(spec))
    worker = subprocess.run([sys.executable, "-m", "shardline.worker", "--spec", str(tmp_path / "spec.yaml"),
                             "--task", "gpucheck"], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "MASTER_PORT": "0"})
    assert worker.returncode == EXIT_NO_GPU, worker.stdout[-3000:] + worker.stderr[-3000:]
    assert json.loads(Path(tmp_path / "gpu-1" / "gpucheck.json").read_text())["gpu"] is False
