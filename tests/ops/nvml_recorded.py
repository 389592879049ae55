"""A recorded-readings NvmlReader: NVML cannot run without a GPU driver, so tests replay readings."""

from __future__ import annotations

import json
from pathlib import Path

from shardline.ops.checks.gpucheck import GpuReading

DATA = Path(__file__).parent / "data"


class RecordedReader:
    """Replays `tests/ops/data/<name>.json`: a healthy reading per GPU, with per-index faults overlaid."""

    def __init__(self, name: str = "nvml-h100-node", gpus: int = 8, faulty: bool = True) -> None:
        doc = json.loads((DATA / f"{name}.json").read_text())
        self.driver = doc["driver_version"]
        faults = doc["faulty"] if faulty else {}
        self._readings = [
            GpuReading(index=i, uuid=f"GPU-00000000-0000-0000-0000-00000000000{i}", pci_bus_id=f"00000000:{i:02X}:00.0",
                       **(doc["healthy"] | faults.get(str(i), {})))
            for i in range(gpus)
        ]

    def driver_version(self) -> str:
        return self.driver

    def readings(self) -> list[GpuReading]:
        return list(self._readings)
