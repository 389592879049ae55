"""`train.float8`: FP8 full fine-tuning (torchao's float8 linears in the decoder blocks, bf16 elsewhere), on CPU.

torch emulates float8 matmul on CPU, so the numbers here are float8's numerics (casts, dynamic scales) and its
composition with FSDP2, DCP checkpoints and export, not its speed (a CPU has no float8 units).
"""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file
from torch import nn

from shardline.errors import SpecError
from shardline.model import float8
from shardline.parallel.fsdp import device_mesh, parallelize
from shardline.rundir import create_run
from shardline.spec import ParallelSpec
from shardline.training.trainer import Trainer
from tests.conftest import REPO, small_spec
from tests.model.float8_worker import affine_batches, tiny_llama

STEPS, TAIL = 40, 10
LOSS_TOLERANCE = 0.02
"""|mean loss of the last TAIL steps, float8 − bf16| in nats. Measured on CPU (torch 2.13, torchao 0.18) from a first
loss of 5.6: after 40 steps (the test's) bf16 0.7134, tensorwise 0.7150 (+0.0016), rowwise 0.7151 (+0.0017); after
100 steps bf16 0.0264, tensorwise 0.0265, rowwise 0.0264. A broken cast or scale moves it by whole nats."""


def _train(model: nn.Module, recipe: str, batches: list[torch.Tensor]) -> list[float]:
    spec = ParallelSpec()
    parallelize(model, device_mesh(spec, 1, "cpu"), spec, "bf16", recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_float8_training_follows_bf16_within_the_stated_tolerance(ctx):
    base, batches = tiny_llama(), affine_batches(STEPS)
    bf16 = _train(copy.deepcopy(base), "none", batches)
    results = {"bf16": bf16}
    for recipe in ("tensorwise", "rowwise"):
        results[recipe] = _train(copy.deepcopy(base), recipe, batches)
    tail = {name: sum(losses[-TAIL:]) / TAIL for name, losses in results.items()}
    print(f"mean loss of the last {TAIL} of {STEPS} steps: " + ", ".join(f"{k} {v:.4f}" for k, v in tail.items()))
    assert bf16[0] > 5.0 and tail["bf16"] < 0.5 * bf16[0]  # it learned: float8 is compared on a falling curve
    for recipe in ("tensorwise", "rowwise"):
        assert abs(tail[recipe] - tail["bf16"]) < LOSS_TOLERANCE, (recipe, tail)


def test_only_the_blocks_linear_layers_become_float8(ctx):
    model = tiny_llama()
    spec = ParallelSpec()
    parallelize(model, device_mesh(spec, 1, "cpu"), spec, "bf16", "tensorwise")
    converted = {name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert len(converted) == 2 * 7 == float8.float8_linears(model)  # q k v o, gate up down per block
    assert all(name.startswith("model.layers.") for name in converted)
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    assert not float8.uses_float8_all_gather(model)  # gloo: weights gathered in bf16


def test_a_router_and_odd_sized_linears_stay_in_bf16():
    assert float8.takes_float8("mlp.gate_proj", nn.Linear(64, 128))
    assert not float8.takes_float8("mlp.gate", nn.Linear(64, 16))  # a mixture's router
    assert not float8.takes_float8("mlp.down_proj", nn.Linear(172, 64))  # 172 is no multiple of 16
    assert float8.float8_all_gather("tensorwise", "cuda") and not float8.float8_all_gather("tensorwise", "cpu")
    assert not float8.float8_all_gather("rowwise", "cuda")


@pytest.mark.parametrize(("overrides", "named"), [
    (("train.precision=bf16", "model.lora.enabled=true"), "LoRA"),
    (("train.precision=fp32",), "train.precision=fp32"),
    (("train.precision=bf16", "parallel.tp=2", "parallel.nproc_per_node=2"), "parallel.tp=2"),
])
def test_float8_is_refused_by_name_with_lora_fp32_and_tensor_parallel(tmp_path, overrides, named):
    with pytest.raises(SpecError) as e:
        small_spec(tmp_path, "train.float8=tensorwise", *overrides)
    assert e.value.field == "train.float8" and named in str(e.value)


def test_float8_is_refused_on_a_gpu_without_fp8_units(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(SpecError) as e:
        float8.check_float8_device("rowwise", "bf16", "cuda")
    assert "A100" in str(e.value) and "8.0" in str(e.value) and e.value.field == "train.float8"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    float8.check_float8_device("rowwise", "bf16", "cuda")  # H100: accepted
    with pytest.raises(SpecError, match="precision is fp32"):  # auto chose fp32 (a CPU without bf16 matmul)
        float8.check_float8_device("rowwise", "fp32", "cpu")


def _float8_trainer(ctx, root, run_id: str) -> Trainer:
    spec = small_spec(root, "train.precision=bf16", "train.float8=tensorwise", "model.arch.intermediate_size=192",
                      "checkpoint.async_save=false", f"run.id={run_id}")
    spec, run_dir = create_run(spec)
    return Trainer(spec, ctx, prepared_for(spec), run_dir, Console(quiet=True))


def prepared_for(spec):
    from shardline.data.prepare import prepare

    return prepare(spec)


def test_a_float8_run_resumes_exactly_from_its_checkpoint_and_exports_plain_weights(ctx, session_dir, tmp_path):
    from shardline.export import export_run

    trainer = _float8_trainer(ctx, session_dir, "float8-resume")
    assert float8.float8_linears(trainer.model) == 2 * 7
    for _ in range(2):
        trainer.train_step()
    trainer.save_checkpoint()
    straight = [trainer.train_step().loss for _ in range(2)]
    resumed = _float8_trainer(ctx, session_dir, "float8-resume")
    resumed.load_checkpoint(2)
    assert [resumed.train_step().loss for _ in range(2)] == straight

    out = tmp_path / "hf"
    export_run(trainer.run_dir, out)
    weights = {}
    for file in out.glob("*.safetensors"):
        weights |= load_file(file)
    assert "model.layers.0.mlp.gate_proj.weight" in weights
    assert all(type(w) is torch.Tensor and w.dtype in (torch.bfloat16, torch.float32) for w in weights.values())


def test_the_planner_counts_float8_gathers_on_nccl_and_the_casts_of_the_largest_linear():
    from shardline.planning.memory import float8_block_linears, float8_cast_bytes, model_shape, plan_memory
    from shardline.spec.resolve import load_spec

    plans = {f8: plan_memory(load_spec("tiny", ["train.precision=bf16", f"train.float8={f8}"]), "h100")
             for f8 in ("none", "tensorwise", "rowwise")}
    spec = load_spec("tiny", ["train.float8=tensorwise"])
    linears = float8_block_linears(model_shape(spec.model), "tensorwise")
    assert len(linears) == 7
    n = spec.train.micro_batch_size * spec.train.seq_len
    # tensorwise on CUDA: the two gathered blocks' float8 weights take 1 byte, not bf16's 2
    assert plans["none"].gather_buffers - plans["tensorwise"].gather_buffers == 2 * sum(i * o for i, o in linears)
    assert plans["rowwise"].gather_buffers == plans["none"].gather_buffers  # rowwise gathers bf16
    for recipe in ("tensorwise", "rowwise"):
        assert plans[recipe].temporaries - plans["none"].temporaries == float8_cast_bytes(linears, n)


MATMULS = (torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default)
"""A float8 matmul reaches dispatch as `aten._scaled_mm` on a GPU and as `aten.mm` of the dequantized operands on
CPU (torch 2.13's emulation); selective checkpointing saves both (parallel.fsdp.SAVED_OPS)."""


def _matmuls(activation_checkpointing: str) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += func in MATMULS
            return func(*args, **(kwargs or {}))

    model, spec = tiny_llama(), ParallelSpec(activation_checkpointing=activation_checkpointing)
    parallelize(model, device_mesh(spec, 1, "cpu"), spec, "bf16", "tensorwise")
    ids = affine_batches(1)[0]
    with Count():
        model(input_ids=ids, labels=ids).loss.backward()
    return Count.calls


def test_selective_checkpointing_keeps_the_float8_matmuls(ctx):
    """3 matmuls per linear (forward, two gradients: 14 float8 linears and the bf16 head) with the selective policy as
    without checkpointing; full checkpointing runs each block's forward again."""
    plain, selective, full = (_matmuls(ac) for ac in ("none", "selective", "full"))
    assert plain == 3 * 15 and selective == plain and full == plain + 14


def test_two_fsdp2_ranks_on_gloo_train_float8_like_bf16(tmp_path):
    """One 2-rank launch: FSDP2 shards the float8 linears' weights (gathered in bf16 on gloo, cast after)."""
    worker = Path(__file__).with_name("float8_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(worker),
           str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads((tmp_path / "losses.json").read_text())
    bf16 = found["none"]["losses"]
    assert bf16[-1] < bf16[0] - 0.5
    for recipe in ("tensorwise", "rowwise"):
        assert found[recipe]["param"] == "DTensor" and found[recipe]["float8_linears"] == 14
        assert max(abs(a - b) for a, b in zip(found[recipe]["losses"], bf16, strict=True)) < LOSS_TOLERANCE


def test_nccls_float8_all_gather_weights_survive_materialize_and_get_their_scales_after_each_step(
        ctx, session_dir, monkeypatch):
    """The GPU layout on CPU, up to the first forward (gloo cannot all-gather float8): the meta model's float8-cast
    weights (torchao's subclass inside FSDP2's DTensor) keep their type through the Trainer's materialize, so the
    optimizer gets its scale hook (one all-reduce per step instead of one per weight)."""
    monkeypatch.setattr(float8, "float8_all_gather", lambda recipe, device_type: recipe == "tensorwise")
    trainer = _float8_trainer(ctx, session_dir, "float8-all-gather")
    assert float8.uses_float8_all_gather(trainer.model)
    assert len(trainer.optimizer._optimizer_step_post_hooks) == 1
    weight = trainer.model.model.layers[0].mlp.up_proj.weight
    assert weight.to_local().abs().sum() > 0  # filled by the seeded init, not left empty


def test_float8_without_torchao_says_what_to_install(ctx, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # an image without torchao
    with pytest.raises(SpecError, match="install torchao"):
        float8.convert_blocks_to_float8(tiny_llama(), "rowwise", "bf16", "cpu")
