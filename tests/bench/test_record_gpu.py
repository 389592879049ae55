"""bench/record_gpu.py on a real GPU session's output (an H200 window, 2026-11-28: the bare layer stack and the
trainer on one workload in one call, as fetched from the device machine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import bench_module

SESSION = Path(__file__).parent / "data" / "gpu-session"


def test_each_measurement_becomes_one_entry_with_its_same_call_baseline(tmp_path):
    record = bench_module("record_gpu")
    results = tmp_path / "results-gpu.json"
    added = record.record(SESSION, "2026-11-28", results)
    bare = json.loads((SESSION / "gpu-13-layers.json").read_text())
    kernels = {name: run for name, run in bare["train"].items() if "tokens_per_s_per_gpu" in run}  # not flash-attn 2
    assert [e["measurement"] for e in added] == [
        *(f"bare layer stack (eager, {name})" for name in kernels),
        "bare layer stack (compiled, sdpa_cudnn)", "protocol B (full)", "protocol B (full)"]
    eager, compiled = added[-2:]
    for entry, folder in ((eager, "trainer-13-layers"), (compiled, "trainer-13-layers-compiled")):
        result = json.loads((SESSION / folder / "protocol-B.json").read_text())
        assert entry["tokens_per_s_per_gpu"] == result["tokens_per_s_per_device"]
        assert entry["command"].startswith("python3 bench/protocols.py B") and entry["command"].endswith(folder)
        assert entry["shape"]["num_layers"] == bare["layers"] and entry["shape"]["rows_per_step"] == bare["batch"]
        assert entry["device"] == bare["device"] == "NVIDIA H200"
    # the baseline is the bare stack in the same compile mode, its faster kernel; the ratio is the two rates'
    fastest = max(k["tokens_per_s_per_gpu"] for k in kernels.values())
    assert eager["baseline"]["tokens_per_s_per_gpu"] == round(fastest, 1)
    assert compiled["baseline"]["name"] == "bare layer stack (compiled, sdpa_cudnn)"
    assert compiled["ratio_vs_baseline"] == pytest.approx(
        compiled["tokens_per_s_per_gpu"] / compiled["baseline"]["tokens_per_s_per_gpu"], abs=1e-3)
    # a second record of the same session adds nothing; the file is the list of every entry
    assert record.record(SESSION, "2026-11-28", results) == []
    assert json.loads(results.read_text()) == added


def test_a_missing_folder_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_module("record_gpu").main([str(tmp_path / "nowhere")])
    assert "nowhere: not a folder" in capsys.readouterr().err
