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


CPU_SESSION = Path(__file__).parent / "data" / "cpu-session"
"""The next window's two new phases as run at small size on a CPU (bench/gpu-session.sh's protocol-a-qwen and
qlora-8b with `--size small`): the files those phases write, with the commands in session.log."""


def test_qwen_and_qlora_phases_become_entries_with_their_baselines_and_start_up(tmp_path):
    record = bench_module("record_gpu")
    added = record.record(CPU_SESSION, "2026-11-28", tmp_path / "results-gpu.json")
    assert [e["measurement"] for e in added] == ["protocol A (small, qwen2.5-7b)",
                                                  "protocol A (small, llama-3.1-8b, QLoRA NF4)"]
    qwen, qlora = added
    # Qwen2.5-7B's family and shapes from the run's own record (its model is a config-only directory, not model.arch)
    assert qwen["shape"] == {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 688, "num_layers": 4,
                             "num_heads": 4, "num_kv_heads": 2, "family": "qwen2", "head_dim": 64, "seq": 128,
                             "rows_per_step": 8}
    assert qwen["baseline"]["name"] == "HF Trainer (gradient checkpointing)"
    assert qwen["ratio_vs_baseline"] == pytest.approx(
        qwen["tokens_per_s_per_gpu"] / qwen["baseline"]["tokens_per_s_per_gpu"], abs=1e-3)
    # QLoRA's baseline is the bf16-base run of the same call, with both peaks and the planner's NF4 terms
    result = json.loads((CPU_SESSION / "qlora-8b" / "protocol-A.json").read_text())
    assert qlora["quantize_base"] == "nf4" and qlora["baseline"]["name"] == "the same LoRA run on a bf16 base"
    assert qlora["baseline"]["tokens_per_s_per_gpu"] == result["bf16_base"]["tokens_per_s_per_device"]
    assert qlora["baseline"]["peak_memory_gib"] == result["bf16_base"]["peak_memory_gib"]
    assert qlora["qlora_memory"] == result["qlora_memory"]
    assert {"planned_dequantize_transient_gib", "measured_peak_difference_gib"} <= qlora["qlora_memory"].keys()
    assert qlora["command"].endswith("--baseline bf16-base --set train.global_batch_size=8 --out /tmp/me/cs/qlora-8b")
    # start-up by part, so the ≤ 15 s goal reads off `to_first_step_s` with the warm-up apart
    for entry in added:
        up = entry["startup"]
        assert up["to_first_step_s"] >= up["launcher_s"] + sum(up["worker_s"].values()) - 0.1
        assert {"first_step_s", "first_step_warmup_s", "first_batch_s"} <= up.keys()


PROFILE_SESSION = Path(__file__).parent / "data" / "cpu-session-profile"
"""bench/gpu-session.sh's profile-a phase (protocol A compiled, steps 4-6 profiled) as run at small size on a CPU,
rows per step cut to 8: the result protocols.py wrote with the breakdown of its trace (the trace itself not kept)."""


def test_a_profiled_protocol_carries_where_its_steps_time_went(tmp_path):
    [entry] = bench_module("record_gpu").record(PROFILE_SESSION, "2026-11-28", tmp_path / "results-gpu.json")
    result = json.loads((PROFILE_SESSION / "profile-a" / "protocol-A.json").read_text())
    assert entry["measurement"] == "protocol A (small, llama-3.1-8b)" and entry["compiled"] and entry["lora"]
    assert entry["profile_breakdown"] == result["profile_breakdown"]
    profiled = entry["profile_breakdown"]
    ms = {c: v["ms_per_step"] for c, v in profiled["categories"].items()}
    # three steps by the host's ops: LoRA's rank-16 matmuls told apart from the base's, each share of the step
    assert (profiled["device"], profiled["steps"], profiled["lora_rank"]) == ("cpu", 3, 16)
    assert ms["lora_matmul"] > 0 and ms["matmul"] > 0 and ms["optimizer"] > 0
    assert sum(ms.values()) == pytest.approx(profiled["step_ms"], rel=0.01)
    assert entry["command"].endswith("--set observe.profile_steps=3 --set train.global_batch_size=8 "
                                     "--out /tmp/pb/cps/profile-a")
