"""Every tested decoder family end to end against transformers (code nobody here wrote): shardline's first
training loss on packed rows equals transformers' eager loss on the same documents one at a time, at one and two
ranks; one optimizer step equals a plain single-process AdamW step; LoRA finds the family's projections; the
export loads in transformers with shardline's logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from shardline.data.prepare import prepare
from shardline.data.tokenizer import train_bpe
from shardline.errors import SpecError
from shardline.model.build import build_model
from shardline.model.families import family_of, layer_windows
from shardline.model.lora import apply_lora
from shardline.rundir import create_run
from shardline.spec import LoraSpec, ModelSpec
from shardline.tasks.text_to_sql.generate import generate_splits
from shardline.training.trainer import Trainer
from tests.adam_oracle import (
    BETAS,
    EPS,
    assert_same_adam_step,
    assert_second_moment_is_the_squared_gradient,
    gradient_from_first_moments,
    replay_adamw,
)
from tests.conftest import REPO, small_spec
from tests.model.families import CONFIGS, FAMILIES, eager, one_document_at_a_time, write_family_checkpoint
from tests.model.families_worker import MOMENT

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("families_worker.py")
STEP = ("train.precision=fp32", "train.micro_batch_size=2", "train.global_batch_size=4", "train.warmup_steps=0",
        "train.lr=1e-3", "train.weight_decay=0.1", "train.peak_tflops=1", "checkpoint.async_save=false",
        "model.arch.vocab_size=512")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    examples = generate_splits(5, 300, 10, 10)["train"]
    tok = train_bpe([t for e in examples for t in (e.question, e.context, e.answer)], 400)
    return {name: write_family_checkpoint(name, tok, root / name) for name in FAMILIES}


def _spec(root: Path, name: str, path: Path, *extra: str):
    return small_spec(root, f"model.path={path}", f"run.id=family-{name}", *STEP, *extra)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


@pytest.fixture(scope="module")
def one_rank(ctx, checkpoints, tmp_path_factory) -> dict[str, dict]:
    """Two training steps of each family on one in-process rank (the weights and optimizer moments after each),
    then a committed checkpoint."""
    root = tmp_path_factory.mktemp("one-rank")
    results = {}
    for name, path in checkpoints.items():
        spec, run_dir = create_run(_spec(root, name, path))
        trainer = Trainer(spec, ctx, prepare(spec), run_dir, Console(quiet=True))
        steps = []
        for _ in range(2):
            record = trainer.train_step()
            named = list(trainer.model.named_parameters())
            steps.append(dict(record=record, params={n: _full(p).detach().clone() for n, p in named},
                              **{moment: {n: _full(trainer.optimizer.state[p][moment]).clone() for n, p in named}
                                 for moment in ("exp_avg", "exp_avg_sq")}))
        trainer.save_checkpoint()
        rows = [r for line in trainer.sample_trace.read_text().splitlines()[:1] for r in json.loads(line)["rows"]]
        results[name] = dict(loss=steps[0]["record"].loss, tokens=steps[0]["record"].tokens, rows=rows,
                             trainer=trainer, run_dir=run_dir, params=steps[0]["params"],
                             moments=steps[0]["exp_avg"], steps=steps)
    return results


@pytest.mark.parametrize("name", FAMILIES)
def test_first_loss_equals_transformers_one_document_at_a_time_and_one_step_equals_plain_adamw(
        name, checkpoints, one_rank):
    got = one_rank[name]
    trainer = got["trainer"]
    plain = eager(checkpoints[name])
    total, count = one_document_at_a_time(plain, trainer.data, got["rows"])
    assert got["tokens"] == count
    print(f"{name}: shardline {got['loss']:.7f} vs transformers {float(total) / count:.7f}")
    assert got["loss"] == pytest.approx(float(total) / count, rel=1e-5)

    # The same step with torch's AdamW on the plain model: the loss shardline normalises, its clipping.
    initial = {k: p.detach().clone() for k, p in plain.named_parameters()}
    (total / count).backward()
    t = trainer.spec.train
    params = [p for p in plain.parameters() if p.requires_grad]
    torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm or float("inf"))
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, lr=t.lr, betas=BETAS, eps=EPS)
    adamw.step()
    first, second = got["steps"]
    for key, p in plain.named_parameters():
        what = f"{name}: {key}"
        # the first moment is the clipped gradient × (1 − β1): the gradients agree
        torch.testing.assert_close(first["exp_avg"][key], adamw.state[p]["exp_avg"], atol=1e-7, rtol=1e-4,
                                   msg=lambda m, what=what: f"{what} first moment: {m}")
        assert_second_moment_is_the_squared_gradient(first["exp_avg_sq"][key], p.grad, what)
        # the step itself, where its sign does not hang on the last bits of the gradient
        assert_same_adam_step(first["params"][key], p.detach(), p.grad, t.lr, what)

    # The optimizer alone: torch's AdamW replayed on shardline's own gradients (recovered from its moments) for
    # both steps gives shardline's weights and second moments to rounding; step 2 is where β2 enters the update.
    grads = [{k: gradient_from_first_moments(first["exp_avg"][k], None) for k in initial},
             {k: gradient_from_first_moments(second["exp_avg"][k], first["exp_avg"][k]) for k in initial}]
    lrs = [first["record"].lr, second["record"].lr]
    weights, second_moments = replay_adamw(initial, grads, lrs, t.weight_decay)
    for key in initial:
        # to 1e-4 of the step, or one fp32 ulp of the weight (a norm's weights near 1 round by 1.2e-7 > lr·1e-4)
        torch.testing.assert_close(second["params"][key], weights[key], atol=t.lr * 1e-4, rtol=2 ** -23,
                                   msg=lambda m, key=key: f"{name}: {key} weights after two steps: {m}")
        torch.testing.assert_close(second["exp_avg_sq"][key], second_moments[key], atol=1e-12, rtol=1e-4,
                                   msg=lambda m, key=key: f"{name}: {key} second moment after two steps: {m}")


def test_the_features_each_family_adds_are_in_its_checkpoint_and_change_the_loss(checkpoints, one_rank):
    """The oracle could not fail if the configs did not exercise what the families add: each feature, dropped,
    changes transformers' own loss on the same documents."""
    dropped = {"qwen2": dict(layer_types=["full_attention"] * 2), "mistral": dict(sliding_window=None),
               "gemma2": dict(attn_logit_softcapping=None, final_logit_softcapping=None),
               "gemma3": dict(sliding_window=4096)}
    for name, change in dropped.items():
        got = one_rank[name]
        with torch.no_grad():
            full, count = one_document_at_a_time(eager(checkpoints[name]), got["trainer"].data, got["rows"])
            other, _ = one_document_at_a_time(eager(checkpoints[name], **change), got["trainer"].data, got["rows"])
        assert float(other) != pytest.approx(float(full), rel=1e-4), name
    assert [family_of(eager(checkpoints[n]).config).name for n in FAMILIES] == [
        "Llama", "Qwen2", "Qwen3", "Mistral", "Gemma 2", "Gemma 3", "Phi-3", "Qwen3-MoE"]
    assert layer_windows(eager(checkpoints["qwen2"]).config) == (None, 16)
    assert layer_windows(eager(checkpoints["mistral"]).config) == (16, 16)


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_two_ranks_give_the_same_first_loss_and_step_as_one(checkpoints, one_rank, tmp_path, layout):
    """All families in one 2-rank torchrun — FSDP shards of every family's blocks, or tensor parallel 2 (each
    rank half the heads, kv-heads and MLP columns; Phi-3's fused projections and Qwen3-MoE's experts are refused):
    the same global batch gives the same loss and the same weights after the step as one rank, and so as
    transformers. Qwen3-MoE's fused experts are sharded on the expert dimension, each rank reading its 4 of 8."""
    jobs = []
    for name, path in checkpoints.items():
        if layout == "tp" and name in ("phi3", "qwen3_moe"):  # both refused by name (test_moe: the mixture's refusal)
            continue
        extra = ["parallel.nproc_per_node=2", *(["parallel.tp=2"] if layout == "tp" else [])]
        spec, _ = create_run(_spec(tmp_path, name, path, *extra))
        jobs.append({"name": name, "spec": spec.model_dump_json(), "out": str(tmp_path / f"{name}.pt")})
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER),
           str(tmp_path / "jobs.json")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for job in jobs:
        name, one = job["name"], one_rank[job["name"]]
        two = json.loads(Path(job["out"]).with_suffix(".json").read_text())
        by_rank = two["rows_by_rank"]
        if layout == "tp":  # both ranks of the tensor-parallel group train the whole batch
            assert by_rank[0] == by_rank[1] and sorted(by_rank[0]) == sorted(one["rows"]), name
        else:
            assert sorted(by_rank[0] + by_rank[1]) == sorted(one["rows"]), name
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-6), name
        from safetensors.torch import load_file

        saved = load_file(job["out"])
        params = {k: v for k, v in saved.items() if not k.startswith(MOMENT)}
        assert params.keys() == one["params"].keys()
        lr = json.loads(job["spec"])["train"]["lr"]
        for key, value in params.items():
            # other ranks (FSDP) or other partial products (TP) sum the gradients in another order: they agree
            # to the last bits, and the steps wherever a gradient's sign does not hang on those bits
            torch.testing.assert_close(saved[MOMENT + key], one["moments"][key], atol=1e-7, rtol=1e-4,
                                       msg=lambda m, what=f"{name}: {key}": f"{what} first moment: {m}")
            grad = gradient_from_first_moments(one["moments"][key], None)
            assert_same_adam_step(value, one["params"][key], grad, lr, f"{layout} {name}: {key}")


def test_export_of_each_family_loads_in_transformers_with_shardlines_logits(one_rank, tmp_path):
    """All exports in one fresh process (as the CLI runs it: no process group)."""
    outs = {name: tmp_path / name for name in one_rank}
    code = ("import sys; from shardline.export import export_run\n"
            "for run, out in zip(sys.argv[1::2], sys.argv[2::2]): export_run(run, out)")
    args = [a for name, out in outs.items() for a in (str(one_rank[name]["run_dir"]), str(out))]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = torch.randint(3, 400, (2, 40), generator=torch.Generator().manual_seed(0))
    for name, out in outs.items():
        trainer = one_rank[name]["trainer"]
        exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert type(exported).__name__ == type(trainer.model).__name__.removeprefix("FSDP")
        with torch.no_grad():
            theirs = exported(input_ids=ids).logits
            trainer.model.eval()
            ours = trainer.model(input_ids=ids).logits
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("name", FAMILIES)
def test_lora_defaults_to_the_familys_attention_projections(name, checkpoints):
    model = build_model(ModelSpec(path=str(checkpoints[name])), 0, {}, device="meta")
    peft = apply_lora(model, LoraSpec(enabled=True, r=4))
    wrapped = sorted({n.rsplit(".", 2)[-2] for n, _ in peft.named_modules() if n.endswith(".lora_A")})
    assert wrapped == sorted(family_of(model.config).lora_targets)
    expected = ["o_proj", "qkv_proj"] if name == "phi3" else ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert wrapped == expected


def test_unsupported_architectures_are_named_errors_listing_the_supported_families():
    from transformers import DbrxConfig, PhimoeConfig, T5Config

    # an untested mixture of experts (the trained ones: tests/model/test_moe.py); DBRX keeps its experts in ffn_config
    for config in (PhimoeConfig(), DbrxConfig(), T5Config()):
        with pytest.raises(SpecError, match="Qwen3 \\(qwen3\\).*Phi-3 \\(phi3\\)") as e:
            family_of(config)
        assert e.value.where == "model.path"
    with pytest.raises(SpecError, match="multimodal"):
        family_of({"model_type": "llava", "text_config": {}, "vision_config": {}})
    assert family_of({"model_type": "gemma3", "text_config": {}, "vision_config": {}}).name == "Gemma 3"
    assert not family_of({"model_type": "olmo2"}).tested
    assert sorted(CONFIGS) == sorted(FAMILIES)


@pytest.mark.parametrize("name", FAMILIES)
def test_generation_with_left_padding_and_a_cache_equals_transformers_eager(name, checkpoints):
    """The evaluation path (no spans: padding masks, a KV cache, one query at a time), Gemma 2's capped scores
    included: shardline's greedy continuations of left-padded prompts are transformers' eager ones."""
    from shardline.training.evaluate import _generate

    ours = build_model(ModelSpec(path=str(checkpoints[name])), 0, {}).eval()
    theirs = eager(checkpoints[name]).eval()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, 400, (n,), generator=gen).tolist() for n in (5, 19, 12)]
    with torch.no_grad():
        got = _generate(ours, prompts, 0, [], 8, torch.device("cpu"), False)
        want = _generate(theirs, prompts, 0, [], 8, torch.device("cpu"), False)
    assert got == want and all(len(c) == 8 for c in got)
