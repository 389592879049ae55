"""`shardline plan` answers the question a user asks (issue 53): how many devices it plans and why, the speed it
assumes, the consumer and mid-range cards, suggestions in the order a user would try them with their time, offload's
host memory and slowdown, recompute and NF4 dequantization in the step time; and the CPU plan's runtime measured at a
run's startup, its steady-state growth named."""

from __future__ import annotations

import re

import pytest

from shardline.cli import main
from shardline.hardware import match_device
from shardline.model.nf4_layout import nf4_bytes
from shardline.planning.cost import estimate_step
from shardline.planning.cpu_runtime import DEFAULT_PRIMITIVE_CACHE, PRIMITIVE_SHARE, steady_growth_bytes
from shardline.planning.devices import CPU_RUNTIME_BYTES, GiB, get_device
from shardline.planning.fixes import KINDS, fixes
from shardline.planning.memory import (
    model_shape,
    nf4_block_weights,
    nf4_dequantize_bytes,
    param_budget,
    plan_memory,
    plan_rows,
)
from shardline.planning.offload import offload_cost
from shardline.planning.step_time import step_time
from shardline.spec.resolve import load_spec

ONE_CARD = ["launch.nnodes=1", "parallel.nproc_per_node=1"]


def _plan(capsys, *args: str) -> str:
    code = main(["plan", *args])
    out = capsys.readouterr().out
    assert code == 0, out
    return out


# ---- how many devices, and why -------------------------------------------------------------------------------
def test_a_gpu_named_without_nproc_is_one_card_and_the_8b_lora_on_an_rtx4090_is_offered_qlora(capsys):
    out = _plan(capsys, "llama-3.1-8b-lora", "--device", "rtx4090")
    first = out.splitlines()[0]
    assert first.startswith("planning for 1 × RTX 4090 24GB:") and "world of 8 is for its H100 80GB" in first, first
    assert "world 1 (FSDP ×1)" in out and "per-device memory on RTX 4090 24GB" in out and "on 1 device " in out
    assert "does not fit" in out
    qlora = next(line for line in out.splitlines() if line.startswith("or, with QLoRA"))
    assert "--set model.lora.quantize_base=nf4" in qlora, out


def test_the_specs_world_stands_for_its_own_gpu_for_nproc_and_for_a_world_set(capsys, tmp_path):
    out = _plan(capsys, "llama-3.1-8b-lora", "--device", "h100")
    assert out.splitlines()[0].startswith("planning for 8 × H100 80GB: the spec's world for its H100 80GB"), out
    out = _plan(capsys, "llama-3.1-8b-lora", "--device", "l4", "--nproc", "4")
    assert out.splitlines()[0].startswith("planning for 4 × L4 24GB: --nproc 4"), out
    out = _plan(capsys, "llama-3.1-8b-lora", "--device", "l4", "--set", "parallel.nproc_per_node=2")
    assert out.splitlines()[0].startswith("planning for 2 × L4 24GB: --set parallel.nproc_per_node=2"), out
    spec = tmp_path / "mine.yaml"  # a spec of the user's own: no world of its own
    spec.write_text("model:\n  path: meta-llama/Llama-3.1-8B-Instruct\n  lora: {enabled: true}\n")
    out = _plan(capsys, str(spec), "--device", "a100")
    assert out.splitlines()[0].startswith("planning for 1 × A100 80GB: --device names one GPU and the spec gives no "
                                          "world"), out
    out = _plan(capsys, "tiny", "--device", "cpu")
    assert out.splitlines()[0].startswith("planning for 2 × cpu (host RAM): the spec's world: 2 processes share"), out


# ---- --memory-gb: whose speed --------------------------------------------------------------------------------
def _step_seconds(out: str) -> float:
    return float(re.search(r"× ([0-9.]+) s/step", out).group(1))


def test_memory_gb_with_a_device_keeps_its_speed_and_alone_names_the_speed_it_assumes(capsys):
    out = _plan(capsys, "llama-3.1-8b-lora", "--device", "rtx4090", "--memory-gb", "20")
    assert re.search(r"capacity\s+│\s+20.00", out), out
    rtx = match_device("rtx4090")
    one = load_spec("llama-3.1-8b-lora", ONE_CARD)
    assert f"{rtx.bf16_tflops:.4g} TFLOP/s" in out
    assert _step_seconds(out) == pytest.approx(step_time(one, rtx.bf16_tflops).seconds, rel=5e-3)
    out = _plan(capsys, "llama-3.1-8b-lora", "--memory-gb", "24")
    h100 = match_device("h100")
    said = next(line for line in out.splitlines() if line.startswith("--memory-gb without --device"))
    assert f"H100 80GB ({h100.bf16_tflops:g} TFLOP/s dense bf16)" in said and "--device" in said, said
    assert _step_seconds(out) == pytest.approx(step_time(load_spec("llama-3.1-8b-lora"), h100.bf16_tflops).seconds,
                                               rel=5e-3)
    out = _plan(capsys, "tiny", "--memory-gb", "3")  # this CPU host: the capacity given, the speed it probes
    assert re.search(r"capacity \(2 processes share the host\)\s+│\s+1.50", out), out
    assert "--memory-gb without --device: the capacity given, the speed this host's CPU probes at" in out


# ---- the catalogue's consumer and mid-range cards -------------------------------------------------------------
@pytest.mark.parametrize("name, key, bf16, gb, gbps", [
    ("NVIDIA GeForce RTX 4090", "rtx4090", 165.2, 24, 1008),  # Ada whitepaper: BF16 with FP32 accumulate, dense
    ("NVIDIA GeForce RTX 3090", "rtx3090", 71.0, 24, 936),  # GA102 whitepaper: BF16 with FP32 accumulate, dense
    ("NVIDIA A10G", "a10g", 70.0, 24, 600),  # AWS's G5 figures (no NVIDIA datasheet)
    ("NVIDIA L40S", "l40s", 362.0, 48, 864),  # L40S datasheet: 362.05 dense
])
def test_consumer_and_mid_range_cards_are_catalogued_with_their_vendor_figures(name, key, bf16, gb, gbps):
    """The vendors' GB (nvidia-smi's total lies between those GB and as many GiB)."""
    gpu = match_device(name)
    assert gpu is not None and gpu.key == key and match_device(key) is gpu
    assert gpu.bf16_tflops == bf16 and gpu.hbm_gbps == gbps
    assert gb * 1e9 <= gpu.memory_bytes <= gb * 2**30 and get_device(key).memory_bytes == gpu.memory_bytes


# ---- suggestions in order, with their time ---------------------------------------------------------------------
def test_suggestions_come_in_the_order_a_user_tries_them_each_fitting_with_its_own_time(capsys):
    spec = load_spec("llama-3.1-8b-lora", ONE_CARD)
    device = get_device("rtx4090")
    found = fixes(spec, device)
    assert [f.kind for f in found] == list(KINDS)  # checkpointing and micro-batch, QLoRA, more devices, offload
    for fix in found:
        assert fix.plan.fits and plan_memory(load_spec("llama-3.1-8b-lora", ONE_CARD + fix.overrides), device).fits
    assert found[1].spec.model.lora.quantize_base == "nf4" and found[2].spec.world_size > 1
    assert found[3].spec.parallel.offload
    out = _plan(capsys, "llama-3.1-8b-lora", "--device", "rtx4090")
    lines = [line for line in out.splitlines() if line.startswith(("fits with", "or, "))]
    assert len(lines) == 4 and lines[0].startswith("fits with checkpointing and micro-batch"), out
    for fix, line in zip(found[:3], lines, strict=False):  # each layout's own time, not the spec's that does not fit
        seconds = estimate_step(fix.spec, "cuda", device.name)[0]
        assert f"{seconds:.3g} s/step" in line and fix.command_line in line, (line, seconds)
    assert "time as given, which does not fit" in out  # the spec's own time, said to be of a layout that does not fit
    assert _step_seconds(out) != pytest.approx(estimate_step(found[0].spec, "cuda", device.name)[0])


def test_offload_says_the_host_memory_it_needs_and_its_modelled_slowdown(capsys):
    """70B on one node of 8 H100: fp32 masters, gradients and AdamW (16 bytes a parameter) in host memory, ~1.1 TB."""
    sets = ["--set", "launch.nnodes=1", "--set", "parallel.dp_replicate=1"]
    out = _plan(capsys, "llama-3.1-70b-fsdp", "--device", "h100", *sets)
    assert out.splitlines()[0].startswith("planning for 8 × H100 80GB"), out
    line = next(line for line in out.splitlines() if "with offload" in line)
    spec = load_spec("llama-3.1-70b-fsdp", ["launch.nnodes=1", "parallel.dp_replicate=1"])
    offload = next(f for f in fixes(spec, "h100") if f.kind == "offload")
    on_device = offload.spec.model_copy(update={"parallel": offload.spec.parallel.model_copy(
        update={"offload": False})})
    cost = offload_cost(offload.spec, plan_memory(on_device, "h100"))
    assert cost.host_bytes_per_node == pytest.approx(16 * 70.55e9, rel=0.01)
    step = estimate_step(offload.spec, "cuda", "h100")[0]
    assert f"host memory {cost.host_bytes_per_node / 2**30:,.0f} GiB per node" in line, line
    assert f"×{(step + cost.added_s) / step:.2g}" in line and f"{step + cost.added_s:.3g} s/step" in line, line
    assert cost.transfer_s > 0 and cost.optimizer_s > 0


# ---- recompute and dequantization in the step time ---------------------------------------------------------------
def test_step_time_counts_the_recomputed_forward_and_the_nf4_dequantization():
    none = load_spec("llama-3.1-8b-lora", ONE_CARD)
    full = load_spec("llama-3.1-8b-lora", [*ONE_CARD, "parallel.activation_checkpointing=full"])
    every2 = load_spec("llama-3.1-8b-lora", [*ONE_CARD, "parallel.activation_checkpointing=full",
                                             "parallel.activation_checkpointing_every=2"])
    base, ac, half = step_time(none, 165.2), step_time(full, 165.2), step_time(every2, 165.2)
    assert base.recompute_s == 0 and ac.compute_s == base.compute_s
    shape = model_shape(full.model)
    pb = param_budget(shape, full.model.lora)
    forward = 2 * pb.layers * pb.block + 4 * shape.layers * shape.heads * shape.hd * full.train.seq_len
    tokens = full.train.global_batch_size * full.train.seq_len
    assert ac.recompute_s == pytest.approx(forward * tokens / (165.2e12 * full.cost.assumed_mfu))
    assert half.recompute_s == pytest.approx(ac.recompute_s / 2)
    qlora = load_spec("llama-3.1-8b-lora", [*ONE_CARD, "parallel.activation_checkpointing=full",
                                            "model.lora.quantize_base=nf4"])
    assert step_time(qlora, 165.2).dequantize_s == 0  # no bandwidth given: not priced
    nf4 = step_time(qlora, 165.2, 1008.0)
    weights = nf4_block_weights(shape, qlora.model.lora)
    per_pass = pb.layers * sum(nf4_bytes(n, 2) + 2 * nf4_dequantize_bytes(n, 2) for n in weights)
    micro_batches = qlora.train.global_batch_size // qlora.train.micro_batch_size
    assert nf4.dequantize_s == pytest.approx(3 * micro_batches * per_pass / 1008e9)  # forward, recompute, backward
    assert estimate_step(qlora, "cuda", "rtx4090")[0] == pytest.approx(nf4.seconds)


# ---- the CPU plan: the runtime a run measures, the steady-state growth named ------------------------------------
def test_a_cpu_run_plans_with_the_runtime_it_measured_and_names_every_term():
    spec = load_spec("tiny", ["train.precision=bf16"])
    typical = plan_memory(spec, "cpu")
    measured = plan_memory(spec, "cpu", runtime_bytes=500 * 2**20)
    assert typical.runtime == CPU_RUNTIME_BYTES and typical.runtime_source == "typical"
    assert measured.runtime == 500 * 2**20 and measured.runtime_source == "measured at startup"
    assert measured.metric_bytes - typical.metric_bytes == 500 * 2**20 - CPU_RUNTIME_BYTES
    assert measured.growth == steady_growth_bytes(2)[0] > 0
    assert measured.tensor_bytes + measured.allocator + measured.growth + measured.runtime == measured.total_bytes
    terms = measured.terms()
    for text in ("tensors", "allocator retention", "caches and heap growth", "steady state",
                 f"runtime {500 / 1024:.2f} (measured at startup)"):
        assert text in terms, terms
    labels = [label for label, _ in plan_rows(measured)]
    assert "runtime (measured at startup)" in labels
    assert any(label.startswith("caches + heap growth") for label in labels)
    assert plan_memory(spec, "h100").growth == 0  # a GPU's metric is its allocator's: no RSS growth


AMX = "flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
AVX512 = "flags\t\t: fpu sse avx2 avx512f avx512_bf16\n"
AVX2 = "flags\t\t: fpu sse avx2\n"


def test_the_steady_state_growth_is_the_cpu_classes_and_scales_with_onednns_cache(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    amx, avx512, fp32 = steady_growth_bytes(2, AMX), steady_growth_bytes(2, AVX512), steady_growth_bytes(4, AVX2)
    assert amx[1] == "amx_bf16" and avx512[1] == "avx512_bf16" and "fp32" in fp32[1]
    assert amx[0] > avx512[0] > 0 and fp32[0] > 0
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(DEFAULT_PRIMITIVE_CACHE // 2))
    halved = steady_growth_bytes(2, AMX)
    assert halved[0] == int(amx[0] * (1 - PRIMITIVE_SHARE / 2)) and "512 primitives" in halved[1]


def test_plan_tiny_on_the_cpu_names_the_runtime_and_the_growth(capsys):
    out = _plan(capsys, "tiny", "--device", "cpu")
    assert "runtime (typical)" in out and "caches + heap growth, steady state" in out, out
    total = float(re.search(r"│ total\s+│\s+([0-9.]+)", out).group(1))
    assert total == pytest.approx(plan_memory(load_spec("tiny"), "cpu").total_bytes / GiB, abs=0.006)
