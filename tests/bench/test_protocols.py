"""bench/protocols.py at small size: NeMo AutoModel's 8B LoRA protocol (A) and torchtitan's 8B full-training
protocol (B) run through the real trainer on random-token rows, and report what the GPU session records."""

from __future__ import annotations

import json

import pytest

from tests.conftest import bench_module

pytestmark = pytest.mark.slow  # one training launch per protocol


@pytest.mark.parametrize("protocol", ["A", "B"])
def test_protocol_runs_at_small_size_with_every_token_a_target(tmp_path, capsys, protocol):
    # B's HF run compiles the whole model (minutes); B runs a variant instead (--set: a changed learning rate).
    # A's baseline checkpoints whole blocks, as it must to fit an 80 GB GPU (the plain one differs by that flag only)
    # A's rows per step cut from 32 to 8 (a variant: the same --set) for a quarter of both runs' compute; the
    # protocol's own 32 is checked in test_the_protocols_shapes_at_small_size. A runs at Qwen2.5-7B's family
    # (transformers' Qwen2 from a config.json, random weights): the same first loss as HF's shows the same model;
    # B keeps Llama-3.1-8B's model.arch.
    extra = (["--shapes", "qwen2.5-7b", "--baseline", "hf-checkpointed", "--set", "train.global_batch_size=8"]
             if protocol == "A" else ["--set", "train.lr=0.0005", "--set", "observe.profile_steps=1"])
    # the script's main in this process (its runs are processes of their own): no interpreter to start for it
    returncode = bench_module("protocols").main([protocol, "--size", "small", "--out", str(tmp_path), *extra])
    stdout, stderr = capsys.readouterr()
    assert returncode == 0, stdout[-3000:] + stderr[-3000:]
    out = json.loads((tmp_path / f"protocol-{protocol}.json").read_text())
    sets = out["overrides"]
    assert out["steps_measured"] == [6, 7, 8, 9, 10] and out["world"] == 1
    rows = int(sets["train.global_batch_size"])
    seq = int(sets["train.seq_len"])
    assert out["tokens_per_step"] == rows * seq and out["loss_tokens_per_step"] == rows * (seq - 1)  # every label
    assert out["tokens_per_s_per_device"] > 0 and 0 < out["mfu_shardline"] < 1 and out["peak_memory_gib"] > 0
    layers, hidden = out["model_shape"]["num_layers"], out["model_shape"]["hidden_size"]
    params = out["params"]  # torchtitan: 6 × every parameter but the embedding (the head counts) + attention
    titan = 6 * (params["trainable"] + params["frozen"]) + 12 * layers * hidden * seq
    assert out["flops_per_token_torchtitan"] == titan
    if protocol == "A":
        assert (seq, rows, int(sets["train.micro_batch_size"])) == (128, 8, 2) and sets["model.lora.r"] == 16
        # HF Trainer + peft beside it: the same model, initial weights and rows (fp32), so the same first loss
        hf = out["hf_trainer"]
        assert hf["first_loss"] == pytest.approx(out["first_loss"], rel=1e-5) and hf["tokens_per_s_per_device"] > 0
        assert hf["gradient_checkpointing"] is True
        ratio = out["tokens_per_s_per_device"] / hf["tokens_per_s_per_device"]
        assert out["ratio_vs_hf_trainer"] == pytest.approx(ratio, rel=1e-2)
        assert params["frozen"] > 10 * params["trainable"]  # adapters on every projection of a frozen base
        assert out["model_shape"]["family"] == "qwen2" and sets["model.random_init"] == "true"
    else:
        assert (seq, sets["parallel.activation_checkpointing"], sets["parallel.compile"]) == (256, "selective", "true")
        assert params["frozen"] == 0
        # the variant reached the trainer: its first step (no warm-up) logs the changed rate, in the run's own log
        assert sets["train.lr"] == "0.0005"
        log = (tmp_path / "protocol-B-shardline.log").read_text()
        assert "step     1/10" in log and "lr 5.00e-04" in log.split("step     1/10")[1].splitlines()[0]
        # a profiled variant keeps the run's ops table and trace beside its result (the run's directory is gone)
        assert "Self CPU" in (tmp_path / "protocol-B-ops.txt").read_text()
        assert (tmp_path / "protocol-B-trace.json.gz").stat().st_size > 0
        # and where the profiled step's time went, from that trace (bench/profile_breakdown.py): by the host's ops on
        # a CPU, every category's share summing to the step
        profiled = out["profile_breakdown"]
        ms = {c: v["ms_per_step"] for c, v in profiled["categories"].items()}
        assert (profiled["device"], profiled["steps"], profiled["lora_rank"]) == ("cpu", 1, None)
        assert sum(ms.values()) == pytest.approx(profiled["step_ms"], rel=0.01)
        assert ms["matmul"] > 0 and ms["optimizer"] > 0 and ms["attention"] > 0 and ms["lora_matmul"] == 0
        assert "profile, 1 step(s) by host ops (CPU trace)" in stdout
    up = out["startup"]  # the command to the first step's start, by part; the first step's warm-up apart
    assert 0 < up["launcher_s"] < up["to_first_step_s"]
    # the worker's own laps from its process's creation: imports apart from the process group, the data, the weights
    assert list(up["worker_s"]) == ["imports and spec", "process group", "run directory", "data", "tokenizer",
                                    "model on meta", "parallelize", "weights", "objective", "optimizer",
                                    "rest of setup"]
    assert up["first_step_s"] > 0 and out["planned_peak_gib"] > 0
    assert f"protocol {protocol} (small, {out['shapes']}, world 1)" in stdout
    assert "start-up to the first step" in stdout


def test_qlora_runs_beside_its_bf16_base_in_one_call_against_the_planners_terms(tmp_path, capsys):
    # one micro-batch per step and one measured step: the comparison's wiring, not its numbers
    returncode = bench_module("protocols").main([
        "A", "--size", "small", "--out", str(tmp_path), "--baseline", "bf16-base", "--set",
        "model.lora.quantize_base=nf4", "--set", "train.global_batch_size=2", "--set", "train.max_steps=6"])
    stdout, stderr = capsys.readouterr()
    assert returncode == 0, stdout[-3000:] + stderr[-3000:]
    out = json.loads((tmp_path / "protocol-A.json").read_text())
    base, memory = out["bf16_base"], out["qlora_memory"]
    assert base["tokens_per_s_per_device"] > 0 and out["steps_measured"] == [6]
    assert out["ratio_vs_bf16_base"] == pytest.approx(out["tokens_per_s_per_device"] / base["tokens_per_s_per_device"],
                                                      rel=1e-2)
    # the same weights, quantized or not: first losses close (NF4's rounding), the NF4 run's plan the smaller
    assert out["first_loss"] == pytest.approx(base["first_loss"], rel=1e-2)
    assert out["planned_peak_gib"] <= base["planned_peak_gib"] and memory["planned_base_saving_gib"] > 0
    # the small model's NF4 weights: q/o (256 × 256) and k/v (256 × 128) of 4 blocks; the MLP's 256 × 688 is not a
    # multiple of torchao's 16,384-element blocks and stays in the compute dtype
    assert memory["nf4_weights"] == 16
    assert memory["planned_dequantize_transient_gib"] == pytest.approx((8 + 3 * 4) * 256 * 256 / 2**30, abs=1e-3)
    assert memory["implied_transient_gib"] == pytest.approx(
        memory["planned_base_saving_gib"] - memory["measured_peak_difference_gib"], abs=2e-3)
    assert "QLoRA is" in stdout and "implied transient" in stdout


def test_bf16_base_is_refused_by_name_without_an_nf4_base(capsys):
    with pytest.raises(SystemExit):
        bench_module("protocols").main(["A", "--size", "small", "--baseline", "bf16-base"])
    assert "--set model.lora.quantize_base=nf4" in capsys.readouterr().err


def test_the_protocols_shapes_at_small_size():
    """What each protocol trains at small size (the sequence divided by 32; batch and steps kept)."""
    protocols = bench_module("protocols")
    a, b = (protocols.protocol_sets(p, "small", 1, None) for p in ("A", "B"))
    assert (a["train.seq_len"], a["train.global_batch_size"], a["train.micro_batch_size"]) == (128, 32, 2)
    assert a["model.lora.enabled"] == "true" and a["model.lora.r"] == 16 and a["train.max_steps"] == 10
    assert (b["train.seq_len"], b["train.global_batch_size"], b["train.micro_batch_size"]) == (256, 2, 2)
    assert b["parallel.activation_checkpointing"] == "selective" and b["parallel.compile"] == "true"


def test_qwen2_5_7b_is_a_config_only_qwen2_directory_with_its_published_shapes(tmp_path):
    protocols = bench_module("protocols")
    model = protocols.config_only_model("qwen2.5-7b", "full", tmp_path / "qwen")
    sets = protocols.protocol_sets("A", "full", 1, str(model), random_init=True)
    assert (sets["model.path"], sets["model.random_init"], sets["train.seq_len"]) == (str(model), "true", 4096)
    assert not list(model.glob("*.safetensors"))  # no weights: the trainer draws them (model.random_init)
    assert protocols.model_shape(sets) == {
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_layers": 28, "num_heads": 28,
        "num_kv_heads": 4, "family": "qwen2", "head_dim": 128}
    config = json.loads((model / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 1e6 and config["tie_word_embeddings"] is False
