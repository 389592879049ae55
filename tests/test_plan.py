"""The memory planner: exact parameter and activation counts, preset verdicts, the CLI, and planned vs
measured peak memory of real training runs (each in a fresh process: peak RSS never goes down)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from shardline.data.prepare import prepare
from shardline.errors import SpecError
from shardline.model.build import decoder_layers, llama_config
from shardline.model.families import family_of, layer_windows
from shardline.model.lora import apply_lora
from shardline.planning.devices import GiB, get_device
from shardline.planning.fixes import suggest
from shardline.planning.memory import (
    KNOWN_MODELS,
    block_saved_bytes,
    model_shape,
    param_budget,
    plan_memory,
)
from shardline.spec import LoraSpec
from shardline.spec.resolve import load_spec, spec_to_yaml
from shardline.training.loss import token_loss_sum
from shardline.training.trainer import Trainer
from tests.conftest import free_port, small_spec
from tests.model.families import COMMON, CONFIGS, DENSE_FAMILIES

LORA_ALL = "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"


@pytest.mark.parametrize("overrides", [
    [],
    ["model.arch.num_kv_heads=2", "model.arch.tie_embeddings=true"],
    ["model.lora.enabled=true", "model.lora.r=4", "model.lora.target_modules=[q_proj,v_proj,down_proj,lm_head]"],
])
def test_analytic_param_count_equals_the_model(overrides):
    spec = load_spec("tiny", ["parallel.nproc_per_node=1", "model.arch.hidden_size=64",
                              "model.arch.intermediate_size=172", "model.arch.num_layers=2", *overrides])
    model = LlamaForCausalLM(llama_config(spec.model, spec.model.arch.vocab_size, {}))
    if spec.model.lora.enabled:
        model = apply_lora(model, spec.model.lora)
    budget = param_budget(model_shape(spec.model), spec.model.lora)
    assert budget.total == sum(p.numel() for p in model.parameters())
    assert budget.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_known_hub_models_have_their_published_sizes():
    sizes = {name: param_budget(shape, LoraSpec()).total for name, shape in KNOWN_MODELS.items()}
    assert sizes["meta-llama/llama-3.1-8b"] == 8_030_261_248
    assert sizes["meta-llama/llama-3.1-70b"] == 70_553_706_496
    assert model_shape(load_spec("llama-3.1-70b-fsdp").model) == KNOWN_MODELS["meta-llama/llama-3.1-70b"]


@pytest.mark.parametrize("name", DENSE_FAMILIES)
@pytest.mark.parametrize("lora", [False, True])
def test_every_familys_config_is_planned_with_its_exact_parameter_count(name, lora, tmp_path):
    """Biases (Qwen2), QK-norm (Qwen3, Gemma 3), four norms (Gemma), fused projections (Phi-3), head_dim ≠
    hidden/heads: the planner's count equals transformers' model built from the saved config.json."""
    cls, extra = CONFIGS[name]
    config = cls(**COMMON, **extra, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    spec = load_spec("tiny", [f"model.path={tmp_path}", f"model.lora.enabled={str(lora).lower()}"]).model
    if lora:
        model = apply_lora(model, spec.lora)
    shape = model_shape(spec)
    assert shape.family.name == family_of(config).name
    budget = param_budget(shape, spec.lora)
    assert budget.total == sum(p.numel() for p in model.parameters())
    assert budget.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_known_non_llama_hub_models_have_the_sizes_of_transformers_models_of_their_configs():
    from transformers import Gemma3TextConfig, MistralConfig, Qwen3Config

    configs = {
        "qwen/qwen3-8b": Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936),
        "mistralai/mistral-7b-v0.3": MistralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=32768),
        "google/gemma-3-12b": Gemma3TextConfig(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                                               num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                                               vocab_size=262208, sliding_window=1024),
    }
    for name, config in configs.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        shape = KNOWN_MODELS[name]
        assert param_budget(shape, LoraSpec()).total == sum(p.numel() for p in model.parameters()), name
        assert shape.family.name == family_of(config).name
        assert shape.windows in ((), layer_windows(config)), name
    for preset, family in [("qwen3-8b-lora", "Qwen3"), ("mistral-7b-lora", "Mistral"), ("gemma-3-12b-lora", "Gemma 3")]:
        assert model_shape(load_spec(preset).model).family.name == family


def test_local_config_json_and_unknown_hub_names(tmp_path):
    cfg = {"hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 3, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = model_shape(load_spec("tiny", [f"model.path={tmp_path}"]).model)
    assert (shape.hidden, shape.layers, shape.kv_heads, shape.vocab, shape.tie) == (128, 3, 2, 1000, True)
    with pytest.raises(SpecError, match="model.path"):
        model_shape(load_spec("tiny", ["model.path=nobody/unknown-model-xyz"]).model)


@pytest.mark.parametrize("overrides", [
    ["train.precision=fp32"],
    ["train.precision=bf16"],
    ["train.precision=bf16", "model.lora.enabled=true", "model.lora.dropout=0.1", LORA_ALL],
    ["train.precision=fp32", "model.arch.num_kv_heads=4", "model.attn_implementation=eager"],
    # compiled blocks: inductor recomputes act(gate) and the RMSNorms' fp32 copies (a LoRA and a full fine-tune)
    ["train.precision=bf16", "model.lora.enabled=true", LORA_ALL, "parallel.compile=true"],
    ["train.precision=fp32", "parallel.compile=true"],
])
def test_block_activation_formula_equals_what_autograd_saves(ctx, session_dir, prepared, overrides):
    """Bytes saved for backward inside one decoder block, counted by storage, versus the formula."""
    spec = small_spec(session_dir, "train.peak_tflops=1", *overrides)
    torch._dynamo.reset()  # past its recompile limit dynamo would run a compiled block eagerly, and save as eager
    trainer = Trainer(spec, ctx, prepared, session_dir / "runs" / "plan", Console(quiet=True))
    layer = decoder_layers(trainer.model)[1]
    # Storages by address, held so that no address is freed and reused while counting.
    inside, weights, saved = [False], {}, {}  # weights: storages that are not the block's activations

    def enter(module, args):
        inside[0] = True
        weights.update((p.untyped_storage().data_ptr(), p.untyped_storage()) for p in module.parameters())

    def pack(t):
        storage = t.untyped_storage()
        if not inside[0]:
            weights[storage.data_ptr()] = storage  # saved before the block (rotary cos/sin): not the block's
        elif storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage
        return t

    layer.register_forward_pre_hook(enter)
    layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    batch = trainer.sampler.step_batches(trainer.rows, 0, 0)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_loss_sum(trainer.model, batch)
    c = 2 if spec.train.precision == "bf16" else 4
    per_token = block_saved_bytes(model_shape(spec.model), c, spec.model.lora, spec.model.attn_implementation,
                                  spec.train.seq_len, "cpu", spec.parallel.compile)
    # Per-document SDPA saves an output and a logsumexp per document; the count of those small storages
    # seen by address varies by a few between runs (unexplained), hence 3% there and 1% elsewhere.
    # Compiled blocks vary more (4,136 planned against 4,160-4,267 bytes a token measured in fp32): 5% there,
    # against the 22% that compile takes off.
    tolerance = 0.05 if spec.parallel.compile else 0.03 if spec.model.attn_implementation == "sdpa" else 0.01
    assert sum(s.nbytes() for s in saved.values()) == pytest.approx(per_token * batch.input_ids.numel(), rel=tolerance)


def _preset(name: str, *overrides: str):
    return load_spec(name, list(overrides))


def test_presets_give_sensible_numbers():
    lora = plan_memory(_preset("llama-3.1-8b-lora"), "h100")  # no AC, compiled: 17.6 GiB of activations
    assert lora.fits and 25 * GiB < lora.total_bytes < 45 * GiB
    eager = plan_memory(_preset("llama-3.1-8b-lora", "parallel.compile=false"), "h100")  # 23.1 GiB eager
    assert 1.15 < eager.activations / lora.activations < 1.35  # act(gate) and the norms' fp32 copies
    # the frozen base in bf16 (2 B/param), the 13.6M adapter weights as fp32 masters, over 8 shards
    assert lora.params == pytest.approx((2 * 8.03e9 + 4 * 13.6e6) / 8, rel=0.01) and lora.optimizer < 0.1 * GiB

    full_ac = ("parallel.activation_checkpointing=full", "parallel.activation_checkpointing_every=1")
    hsdp = plan_memory(_preset("llama-3.1-70b-fsdp", "parallel.dp_replicate=2", *full_ac), "h100")  # 2 × 8 shards
    assert hsdp.params + hsdp.grads + hsdp.optimizer == pytest.approx(16 * 70.55e9 / 8, rel=0.01)  # 16 B/param / 8
    assert not hsdp.fits and plan_memory(_preset("llama-3.1-70b-fsdp"), "b200").fits
    # Fully sharded over the same 16 GPUs the fp32 master + AdamW state is 66 GiB per H100: FSDP's buffers
    # and the activations push it over 80 GB even with full AC; with full AC it fits on H200s, or on 32 H100s.
    full16 = ["parallel.dp_replicate=1", "parallel.dp_shard=16", *full_ac]
    assert not plan_memory(_preset("llama-3.1-70b-fsdp", *full16), "h100").fits
    assert plan_memory(_preset("llama-3.1-70b-fsdp", *full16), "h200").fits
    assert plan_memory(_preset("llama-3.1-70b-fsdp", "launch.nnodes=4", *full_ac), "h100").fits


def test_activation_levers_order_and_scale():
    base = ["launch.nnodes=1", "parallel.dp_replicate=1", "train.global_batch_size=64",
            "model.attn_implementation=sdpa", "parallel.compile=false", "parallel.activation_checkpointing_every=1"]
    acts = {ac: plan_memory(_preset("llama-3.1-70b-fsdp", *base, f"parallel.activation_checkpointing={ac}"),
                            "h200").saved_activations for ac in ("none", "selective", "full")}
    assert acts["none"] > 2 * acts["selective"] > 2 * acts["full"]
    half = plan_memory(_preset("llama-3.1-70b-fsdp", *base, "parallel.activation_checkpointing=full",
                               "train.micro_batch_size=4"), "h200")
    assert half.saved_activations == pytest.approx(acts["full"] / 2, rel=0.05)
    every2 = plan_memory(_preset("llama-3.1-70b-fsdp", *base, "parallel.activation_checkpointing=full",
                                 "parallel.activation_checkpointing_every=2"), "h200").saved_activations
    assert acts["full"] < every2 < acts["none"]


def test_70b_on_8_gpus_without_ac_does_not_fit_and_the_suggestion_does():
    one_node = ["launch.nnodes=1", "parallel.dp_replicate=1", "parallel.activation_checkpointing=none",
                "train.global_batch_size=64"]
    spec = _preset("llama-3.1-70b-fsdp", *one_node)
    assert spec.world_size == 8 and spec.train.micro_batch_size == 8
    assert not plan_memory(spec, "h100").fits
    fix = suggest(spec, "h100")
    assert fix is not None and fix.plan.fits
    assert plan_memory(_preset("llama-3.1-70b-fsdp", *one_node, *fix.overrides), "h100").fits
    no_offload = suggest(spec, "h100", offload=False)
    assert no_offload is not None and "parallel.offload=true" not in no_offload.overrides
    assert plan_memory(_preset("llama-3.1-70b-fsdp", *one_node, *no_offload.overrides), "h100").fits


def test_suggestion_prefers_activation_checkpointing():
    spec = _preset("llama-3.1-8b-lora", "model.lora.enabled=false", "parallel.activation_checkpointing=none",
                   "train.micro_batch_size=32", "train.global_batch_size=256", "model.attn_implementation=sdpa")
    fix = suggest(spec, "h100")
    assert fix is not None and fix.overrides[0].startswith("parallel.activation_checkpointing=")
    assert suggest(_preset("llama-3.1-8b-lora"), "h100") is None  # already fits


def test_devices_and_cpu_share():
    assert get_device("h200").memory_bytes > get_device("h100").memory_bytes
    assert get_device("h100", memory_gb=40).memory_bytes == 40 * GiB
    with pytest.raises(SpecError, match="--device"):
        get_device("tpu")
    spec = load_spec("tiny", ["parallel.nproc_per_node=2"])
    plan = plan_memory(spec, "cpu")
    assert plan.capacity_bytes == get_device("cpu").memory_bytes // 2
    assert plan.metric_bytes == plan.total_bytes and plan.allocator > 0
    gpu = plan_memory(spec, "h100")
    assert gpu.metric_bytes == gpu.total_bytes - gpu.runtime and gpu.allocator == 0


def test_cli_plan_prints_the_table_and_a_fix(capsys):
    """`shardline plan`'s main in the test's process (the CLI's own process start is covered by every launch)."""
    from shardline.cli import main

    assert main(["plan", "llama-3.1-70b-fsdp", "--device", "h100"]) == 0
    out = capsys.readouterr().out
    for text in ("per-device memory on H100 80GB", "optimizer state", "activations", "total", "does not fit",
                 "fits with", "--set "):
        assert text in out, out
    assert main(["plan", "llama-3.1-8b-lora", "--device", "h200"]) == 0
    out = capsys.readouterr().out
    assert "fits:" in out and "H200" in out
    assert main(["plan", "tiny", "--device", "tpu"]) == 2 and "--device" in capsys.readouterr().err


def test_8b_lora_with_its_bf16_base_fits_one_a100_40gb_with_the_checkpointing_plan_proposes(capsys):
    """The frozen base in bf16 (no fp32 master, 2 bytes per parameter): the 8B LoRA preset on one A100 40 GB misses
    at its own settings, and the one change `plan` proposes (full activation checkpointing, same micro-batch)
    fits; with the base in fp32, as before, it would need ~30 GiB for the parameters alone."""
    from shardline.cli import main

    def plan(*sets: str) -> str:
        code = main(["plan", "llama-3.1-8b-lora", "--device", "a100", "--memory-gb", "40",
                     *(a for kv in ("parallel.nproc_per_node=1", *sets) for a in ("--set", kv))])
        out = capsys.readouterr().out
        assert code == 0, out
        return out

    first = plan()
    assert "does not fit" in first and "fits with" in first, first
    fix = first.split("fits with", 1)[1].split("--set ", 1)[1].split()[0]
    assert fix == "parallel.activation_checkpointing=full", first
    params = next(line for line in first.splitlines() if line.startswith("│ parameters"))
    assert float(params.split("│")[2]) == pytest.approx(8.03e9 * 2 / 2**30, rel=0.01)  # bf16, not fp32
    second = plan(fix)
    assert "fits:" in second and "does not fit" not in second and "micro-batch 8 × 512" in second, second


# ---- planned vs measured peak memory of real runs ------------------------------------------------
ARCH = ["model.arch.hidden_size=256", "model.arch.intermediate_size=688", "model.arch.num_heads=4",
        "model.arch.num_kv_heads=2", "model.arch.num_layers=8", "model.arch.vocab_size=512",
        "model.arch.max_position_embeddings=512", "train.seq_len=512", "train.micro_batch_size=4",
        "train.global_batch_size=4", "train.precision=fp32"]
RUNS = {
    "tiny-bf16": ["train.global_batch_size=8"],
    "fp32-no-ac": ARCH,
    "fp32-full-ac": [*ARCH, "parallel.activation_checkpointing=full"],
    "fp32-lora-dropout": [*ARCH, "model.lora.enabled=true", "model.lora.dropout=0.05", LORA_ALL],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_planned_peak_within_20_percent_of_measured(tmp_path, session_dir, name):
    spec = load_spec("tiny", [
        f"run.dir={tmp_path}", f"run.id=plan-{name}", f"data.cache_dir={session_dir / 'plan-cache'}",
        "data.train_size=600", "data.validation_size=8", "data.test_size=1", "train.max_steps=2",
        "train.warmup_steps=1", "train.eval_examples=0", "train.log_every=1", "train.peak_tflops=1",
        "parallel.nproc_per_node=1", *RUNS[name],
    ])
    prepare(spec)  # here, so the measured process only reads the cache
    run_dir = tmp_path / spec.run.id
    run_dir.mkdir()
    (run_dir / "spec.yaml").write_text(spec_to_yaml(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # two threads, as on the project's machines: MKL/OpenMP keep per-thread buffers, so a bigger host's thread count
    # would add to the measured peak what the plan (fitted at two) does not count
    env |= {"MASTER_PORT": str(free_port()), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-m", "shardline.worker", "--spec", str(run_dir / "spec.yaml")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    records = [json.loads(line) for line in Path(run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = max(r["mem_peak_bytes"] for r in records if r["kind"] == "train")
    # two steps: the kernel caches and the heap have not grown to their steady state yet, so the plan is compared
    # without that term (the runtime as the trainer measured it at startup)
    setup = next(r for r in records if r.get("event") == "setup")
    plan = plan_memory(spec, runtime_bytes=setup["startup_rss_bytes"])
    planned = plan.metric_bytes - plan.growth
    print(f"{name}: planned {planned / 2**20:.0f} MiB, measured {measured / 2**20:.0f} MiB "
          f"({100 * (planned / measured - 1):+.1f}%)")
    assert planned == pytest.approx(measured, rel=0.20)


def test_dpo_step_time_counts_the_adapters_off_reference_forward():
    """LoRA's step is a forward and the input-gradient backward of the frozen base (4·N per token); DPO with the
    adapters-off reference adds a third pass (2·N): about 1.5× the step. A precomputed reference adds nothing per
    step."""
    from shardline.planning.cost import estimated_step_time

    sft = estimated_step_time(load_spec("llama-3.1-8b-lora", []), 989.0)
    dpo = estimated_step_time(load_spec("llama-3.1-8b-lora", ["train.objective=dpo"]), 989.0)
    assert 1.4 < dpo / sft < 1.55
    table = load_spec("llama-3.1-8b-lora", ["train.objective=dpo", "train.dpo.reference=precomputed"])
    assert estimated_step_time(table, 989.0) == sft


def test_grpo_plan_counts_the_sampling_and_says_when_generation_dominates():
    """8B LoRA on an H100: each decoded token reads the whole bf16 model (16 GB at 3.35 TB/s ≈ 4.8 ms), 128 of them
    per step: sampling ≥ 0.6 s against 0.32 s of training, so generation dominates and the cost counts it. Fewer,
    shorter completions of the tiny model on this CPU are bound by compute instead."""
    from shardline.planning.cost import estimated_step_time, plan_cost_lines
    from shardline.planning.rollout import rollout_estimate

    spec = load_spec("llama-3.1-8b-lora", ["train.objective=grpo"])
    lines = plan_cost_lines(spec, "cuda", "NVIDIA H100 80GB HBM3")
    sampling = next(line for line in lines if line.startswith("GRPO sampling"))
    assert "memory-bound decode" in sampling and "generation dominates the step" in sampling, sampling
    from shardline.hardware import match_device

    r = rollout_estimate(spec, 989.0, match_device("NVIDIA H100 80GB HBM3"))
    assert r.sequences == spec.train.global_batch_size // spec.world_size
    assert 128 * 16e9 / 3.35e12 < r.seconds < 2 * 128 * 16.1e9 / 3.35e12  # the weights read per decoded token
    assert r.kv_cache_bytes == 2 * 32 * 8 * 128 * 2 * r.sequences * spec.train.seq_len  # Llama-3.1-8B: 8 KV heads
    sft = estimated_step_time(spec, 989.0)
    assert f"{sft + r.seconds:.3g} s/step" in lines[0] and "GRPO's sampling included" in lines[0]
    tiny = load_spec("tiny", ["train.objective=grpo"])
    assert rollout_estimate(tiny, 1.0, None).bound == "compute"
    reused = load_spec("llama-3.1-8b-lora", ["train.objective=grpo", "train.grpo.num_iterations=2"])
    assert rollout_estimate(reused, 989.0, match_device("NVIDIA H100 80GB HBM3")).seconds == pytest.approx(
        r.seconds / 2)  # one sampling serves two steps
    oversampled = load_spec("llama-3.1-8b-lora", ["train.objective=grpo", "train.grpo.oversample=4"])
    four = rollout_estimate(oversampled, 989.0, match_device("NVIDIA H100 80GB HBM3"))
    assert four.seconds == pytest.approx(4 * r.seconds) and four.kv_cache_bytes == r.kv_cache_bytes  # 4 calls
    assert "GRPO sampling: 4 × " in "\n".join(plan_cost_lines(oversampled, "cuda", "NVIDIA H100 80GB HBM3"))


def test_grpo_memory_plan_peaks_while_sampling_when_the_kv_cache_outgrows_the_training_step():
    """Many sequences per rank: the keys and values of all of them (sampled together) outgrow a micro-batch's
    activations, and the plan's peak moves to the sampling, with the KV cache as its own row."""
    from shardline.planning.memory import kv_cache_bytes, model_shape, plan_memory, plan_rows

    few = plan_memory(load_spec("llama-3.1-8b-lora", ["train.objective=grpo"]), "h100")
    assert few.phase != "GRPO sampling" and few.kv_cache == 0
    spec = load_spec("llama-3.1-8b-lora", ["train.objective=grpo", "train.global_batch_size=4096"])
    many = plan_memory(spec, "h100")
    sequences = 4096 // spec.world_size
    assert many.phase == "GRPO sampling" and many.activations == 0
    assert many.kv_cache == kv_cache_bytes(model_shape(spec.model), 2, sequences, spec.train.seq_len)
    assert ("KV cache (GRPO's sampling)", f"{many.kv_cache / 2**30:.2f}") in plan_rows(many)
