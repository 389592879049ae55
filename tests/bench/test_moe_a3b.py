"""bench/moe_a3b.py (gpu-session.sh's moe-a3b phase): the layer count the planner fits, NeMo's FLOP formula, and the
whole phase at small size in this process — both shardline runs (the real Trainer on the in-process rank, balanced
routing forced by the environment as the phase sets it) and HF Trainer + grouped_mm experts on the real run's rows —
to the result file and bench/record_gpu.py's entries, so a GPU window does not find the phase's bugs."""

from __future__ import annotations

import json
import time

import pytest
from rich.console import Console

from shardline.data.prepare import prepare
from shardline.rundir import create_run, update_manifest
from shardline.spec.resolve import load_spec
from shardline.training.trainer import Trainer
from tests.conftest import bench_module


def test_the_planner_fits_10_layers_on_an_h200_and_nemos_formula_gives_its_277_tflops(tmp_path):
    moe = bench_module("moe_a3b")
    full = moe.QWEN3_30B_A3B
    fits = {device: moe.layers_that_fit(full, "full", tmp_path / device, device) for device in ("h200", "h100")}
    assert {device: layers for device, (layers, _) in fits.items()} == {"h200": 10, "h100": 4}
    _, plan = fits["h200"]
    assert plan.total_bytes <= moe.FIT_SHARE * plan.capacity_bytes and plan.total_params == pytest.approx(6.85e9, 1e-3)
    # NeMo AutoModel's qwen3_flops at all 48 layers and seq 4096 times its 12,040 tok/s/GPU: its published 277
    assert 12_040 * moe.nemo_flops_per_token(full, 48, 4096) / 1e12 == pytest.approx(277.0, abs=0.05)


def test_the_phase_runs_at_small_size_and_reports_every_field(ctx, tmp_path, monkeypatch, capsys):
    moe, hf_baseline = bench_module("moe_a3b"), bench_module("hf_baseline")
    cache = tmp_path / "cache"
    routings = []

    def in_process(sets, runs, _log, routing):  # the trainer a `shardline train` would run, on this process's rank
        spec, run_dir = create_run(load_spec(None, [f"{k}={v}" for k, v in sets.items()]
                                             + [f"run.dir={runs}", f"data.cache_dir={cache}"]))
        started = time.time()
        with monkeypatch.context() as env:  # what train_shardline gives the run's environment
            env.delenv("SHARDLINE_BALANCED_ROUTING", raising=False)
            if routing == "balanced":
                env.setenv("SHARDLINE_BALANCED_ROUTING", "1")
            routings.append(routing)
            data = prepare(spec)
            update_manifest(run_dir, dataset_version=data.version)  # as the worker records it
            Trainer(spec, ctx, data, run_dir, Console(quiet=True)).fit()
        return 0, run_dir, started

    def hf_in_process(run):
        with monkeypatch.context() as env:  # one plain process, as bench/hf_baseline.py runs
            for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
                env.delenv(name, raising=False)
            return hf_baseline.train_hf(run, "M", True, moe.protocols.WARMUP_STEPS)

    monkeypatch.setattr(moe, "train_shardline", in_process)
    monkeypatch.setattr(moe, "train_hf", hf_in_process)
    out = tmp_path / "moe-a3b"
    assert moe.main(["--size", "small", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    result = json.loads((out / "moe-a3b.json").read_text())
    assert routings == ["balanced", "real"]
    # the small family fits whole on this CPU: all 4 of its layers, said before anything runs
    assert result["layers"] == result["layers_planned"] == result["config"]["num_hidden_layers"] == 4
    assert stdout.startswith("layers: 4 of 4 fit")
    sets = result["overrides"]
    assert (sets["train.seq_len"], sets["train.micro_batch_size"], sets["train.global_batch_size"]) == (128, 4, 8)
    assert sets["parallel.activation_checkpointing"] == "full" and sets["model.random_init"] == "true"
    flops = result["flops_per_token"]
    # shardline's formula (no causal halving, the router counted) above NeMo's by at least attention's causal half
    layers, width = 4, 4 * 16
    assert flops["shardline_formula"] - flops["nemo_formula"] >= 6 * layers * width * 128
    balanced, real = result["runs"]["balanced"], result["runs"]["real"]
    for run in (balanced, real):
        assert run["steps_measured"] == [6, 7, 8, 9, 10] and run["tokens_per_step"] == 8 * 128
        assert run["tokens_per_s_per_device"] > 0 and run["peak_memory_gib"] > 0 and run["planned_peak_gib"] > 0
        for name, per_token in flops.items():  # model TFLOP/s per GPU = tok/s × active FLOPs per token
            assert run["model_tflops_per_gpu"][name] == pytest.approx(
                run["tokens_per_s_per_device"] * per_token / 1e12, abs=0.051)
        # torchtitan's formula counts active parameters too: below 6 × every parameter
        assert run["flops_per_token_torchtitan"] < 6 * (run["params"]["trainable"] + run["params"]["frozen"])
    # balanced routing forced: every expert takes the same share of every step (8 experts, top 2, 512 tokens); the
    # router's own choice does not
    assert balanced["expert_imbalance"] == {"mean": 1.0, "max": 1.0}
    assert real["expert_imbalance"]["mean"] > 1.0
    # HF Trainer + grouped_mm on the real run's model, initial weights and rows: the same first loss in fp32
    hf = result["hf_trainer"]
    assert hf["first_loss"] == pytest.approx(real["first_loss"], rel=1e-5) and hf["weights_dtype"] == "torch.float32"
    assert hf["gradient_checkpointing"] is True and hf["model_tflops_per_gpu"]["nemo_formula"] >= 0
    assert result["ratio_vs_hf_trainer"]["real"] == pytest.approx(
        real["tokens_per_s_per_device"] / hf["tokens_per_s_per_device"], rel=1e-2)
    assert set(result["ratio_vs_hf_trainer"]) == {"balanced", "real"}
    for line in ("shardline, balanced routing:", "shardline, real routing:", "HF Trainer + grouped_mm experts",
                 "model TFLOP/s per GPU", "imbalance 1.00 mean", "goals (one H100): ≥ 277"):
        assert line in stdout
    # recorded as the session's other phases are: one entry per routing, each with HF as its baseline
    (out.parent / "session.log").write_text(f"=== moe-a3b: python3 bench/moe_a3b.py --out {out}\n")
    entries = bench_module("record_gpu").record(out.parent, "2026-11-28", tmp_path / "results-gpu.json")
    assert [e["measurement"] for e in entries] == ["Qwen3-30B-A3B, 4 of 4 layers (small, balanced routing)",
                                                   "Qwen3-30B-A3B, 4 of 4 layers (small, real routing)"]
    for entry, run in zip(entries, (balanced, real), strict=True):
        assert entry["tokens_per_s_per_gpu"] == run["tokens_per_s_per_device"]
        assert entry["model_tflops_per_gpu"] == run["model_tflops_per_gpu"]
        assert entry["expert_imbalance"] == run["expert_imbalance"]
        assert entry["baseline"]["name"] == "HF Trainer + grouped_mm (gradient checkpointing)"
        assert entry["command"] == f"python3 bench/moe_a3b.py --out {out}"
