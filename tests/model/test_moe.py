"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE with its gated shared expert, Mixtral, OLMoE) against
transformers' own model on the same weights: checkpoints saved by transformers (per-expert keys) load into the fused
experts and export back with the input's key set; the loss and every gradient of shardline's training forward equal
transformers' with the router auxiliary loss on and off; one training step of the Trainer on an in-process rank
(FSDP2 sharding the fused experts on dim 0) equals transformers on each packed document alone; LoRA trains attention
with the experts and the router frozen; FLOPs count the active experts; what is not supported is a named error.

Tiny configs from transformers' own config classes, fp32, dims multiples of 8, init std 0.2: at that scale a token
routed to the wrong experts moves the loss (checked below), so the oracles could fail.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MixtralConfig,
    OlmoeConfig,
    PreTrainedTokenizerBase,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from shardline.data.loader import IGNORE_INDEX, Batch
from shardline.data.prepare import prepare
from shardline.data.spans import document_spans
from shardline.data.tokenizer import train_bpe
from shardline.errors import SpecError
from shardline.export import _save_full
from shardline.model import moe
from shardline.model.build import build_model
from shardline.model.families import expert_capacity, family_of
from shardline.model.flops import flops_per_token
from shardline.model.lora import apply_lora, quantize_frozen_base
from shardline.model.router_bias import router_bias
from shardline.model.router_lora import router_adapters_off
from shardline.model.sharded_load import _checkpoint_files, _read
from shardline.parallel.context import check_context_parallel
from shardline.parallel.tensor import check_tensor_parallel
from shardline.rundir import create_run
from shardline.spec import LoraSpec, ModelSpec
from shardline.spec.resolve import load_spec
from shardline.tasks.text_to_sql.generate import generate_splits
from shardline.training.loss import token_loss_sum
from shardline.training.preference import adapters_off
from shardline.training.trainer import Trainer
from tests.adam_oracle import BETAS
from tests.conftest import small_spec
from tests.oracle import IGNORE, documents_of_rows

EXPERTS, TOP_K, AUX_COEF = 8, 2, 0.05
COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, initializer_range=0.2, num_experts_per_tok=TOP_K,
              router_aux_loss_coef=AUX_COEF)
CONFIGS = {
    "qwen3_moe": (Qwen3MoeConfig, dict(num_experts=EXPERTS, moe_intermediate_size=32, intermediate_size=64,
                                       head_dim=16)),
    "qwen2_moe": (Qwen2MoeConfig, dict(num_experts=EXPERTS, moe_intermediate_size=32, intermediate_size=64,
                                       shared_expert_intermediate_size=48)),
    "mixtral": (MixtralConfig, dict(num_local_experts=EXPERTS, intermediate_size=32)),
    "olmoe": (OlmoeConfig, dict(num_experts=EXPERTS, intermediate_size=32)),
}
FAMILIES = list(CONFIGS)
PER_EXPERT_KEY = {"qwen3_moe": "model.layers.0.mlp.experts.7.gate_proj.weight",
                  "qwen2_moe": "model.layers.0.mlp.experts.7.up_proj.weight",
                  "mixtral": "model.layers.0.block_sparse_moe.experts.7.w3.weight",
                  "olmoe": "model.layers.0.mlp.experts.7.down_proj.weight"}
STEP = ("train.precision=fp32", "train.micro_batch_size=2", "train.global_batch_size=2", "train.warmup_steps=0",
        "train.lr=1e-3", "train.weight_decay=0.1", "train.peak_tflops=1", "checkpoint.async_save=false",
        "model.arch.vocab_size=512", "train.max_steps=1")


def write_checkpoint(name: str, tok: PreTrainedTokenizerBase, path: Path, **overrides) -> Path:
    cls, extra = CONFIGS[name]
    config = cls(**COMMON, **extra, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                 pad_token_id=tok.pad_token_id, **overrides)
    torch.manual_seed(sum(map(ord, name)))
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    examples = generate_splits(5, 300, 10, 10)["train"]
    return train_bpe([t for e in examples for t in (e.question, e.context, e.answer)], 400)


@pytest.fixture(scope="module")
def checkpoints(tok, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {name: write_checkpoint(name, tok, root / name) for name in FAMILIES}


def stored_keys(path: Path) -> set[str]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return set(f.keys())


def reference(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def ours(path: Path) -> torch.nn.Module:
    return build_model(ModelSpec(path=str(path)), 0, {})


# ---- families, loading and export -----------------------------------------------------------------------------
def test_per_expert_checkpoints_load_into_the_fused_experts_and_export_with_the_inputs_keys(checkpoints, tmp_path):
    for name, path in checkpoints.items():
        keys = stored_keys(path)
        assert PER_EXPERT_KEY[name] in keys and not any(k.endswith("experts.gate_up_proj") for k in keys), name
        model, theirs = ours(path), reference(path)
        assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == EXPERTS
        want = theirs.state_dict()
        got = model.state_dict()
        assert got.keys() == want.keys(), name
        diff = max((got[k] - want[k]).abs().max().item() for k in got)
        print(f"{name}: loaded weights vs transformers' from_pretrained: max abs diff {diff}")
        assert diff == 0.0, name
        # a rank holding experts 2..5 and rows 8..40 of gate_up reads only those experts' tensors, gate and up parts
        fused = "model.layers.1.mlp.experts.gate_up_proj"
        stored = _checkpoint_files(str(path), model)[fused]
        region = (slice(2, 5), slice(8, 40), slice(0, 64))
        assert torch.equal(_read(stored, region), want[fused][region]), name

        out = tmp_path / name
        _save_full(model, {}, out)  # what `shardline export` writes for a full fine-tune
        assert stored_keys(out) == keys, name
        _save_full(model, {}, tmp_path / f"{name}-fused", original_format=False)
        fused_keys = stored_keys(tmp_path / f"{name}-fused")
        assert fused in fused_keys and PER_EXPERT_KEY[name] not in fused_keys
        # a fused checkpoint loads as it is and exports fused again (the input's layout)
        again = ours(tmp_path / f"{name}-fused")
        assert all(torch.equal(again.state_dict()[k], want[k]) for k in want), name


def test_families_accept_the_four_mixtures_and_refuse_the_others_by_name():
    from transformers import DbrxConfig, DeepseekV3Config, GptOssConfig, Llama4TextConfig, PhimoeConfig

    assert [family_of(cls(**extra)).name for cls, extra in CONFIGS.values()] == [
        "Qwen3-MoE", "Qwen2-MoE", "Mixtral", "OLMoE"]
    assert all(family_of(cls(**extra)).experts for cls, extra in CONFIGS.values())
    with pytest.raises(SpecError, match="attention sinks.*\\[E, H, 2I\\].*interleaved.*clamped SwiGLU.*MXFP4") as e:
        family_of(GptOssConfig())
    assert "Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE" in e.value.fix
    for config, why in ((DeepseekV3Config(), "latent attention"), (Llama4TextConfig(), "Llama 4")):
        with pytest.raises(SpecError, match=why) as e:
            family_of(config)
        assert "Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE" in e.value.fix and "Llama (llama)" in e.value.fix
    for config in (DbrxConfig(), PhimoeConfig()):
        with pytest.raises(SpecError, match="untested family .*Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE"):
            family_of(config)
    config = Qwen3MoeConfig(**CONFIGS["qwen3_moe"][1])
    with pytest.raises(SpecError, match="mixture of experts") as e:
        check_tensor_parallel(config, 2)
    assert e.value.where == "parallel.tp"
    with pytest.raises(SpecError, match="mixture of experts"):
        check_context_parallel(config, 2)


def test_the_planner_counts_a_mixtures_total_and_active_parameters_as_transformers_model_has_them(checkpoints):
    """The planner sizes a mixture from its config alone: for each family's checkpoint its parameters equal those of
    transformers' model, and the routed experts and active parameters it plans FLOPs and MFU from equal what
    model/flops.py counts on that model (N_active = N − (1 − k/E)·N_experts); Qwen3-30B-A3B, known offline, against
    transformers' Qwen3MoeConfig of it built on the meta device: 30.5B parameters, 3.3B active, and LoRA's adapters
    as peft adds them."""
    from shardline.model.flops import count_params
    from shardline.planning.memory import model_shape, param_budget
    from shardline.planning.step_time import planned_counts
    from shardline.spec.resolve import load_spec

    def same(spec, model) -> None:
        planned, theirs = planned_counts(spec), count_params(model)
        assert param_budget(model_shape(spec.model), spec.model.lora).total == theirs.total
        assert (planned.trainable, planned.frozen) == (theirs.trainable, theirs.frozen)
        assert (planned.experts_trainable, planned.experts_frozen) == (theirs.experts_trainable, theirs.experts_frozen)
        assert planned.active_trainable + planned.active_frozen == theirs.active_trainable + theirs.active_frozen

    for name in FAMILIES:
        same(load_spec("tiny", [f"model.path={checkpoints[name]}"]), reference(checkpoints[name]))
    qwen3 = Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                           head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                           vocab_size=151936, norm_topk_prob=True, tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(qwen3)
    full = load_spec("qwen3-30b-a3b")
    same(full, model)
    counts = planned_counts(full)
    # Qwen's model card: 30.5B, 3.3B activated; with the input embedding counted, 3.35B
    assert round(counts.total / 1e9, 1) == 30.5 and round((counts.active_trainable + counts.embedding) / 1e9, 2) == 3.35
    lora = load_spec("qwen3-30b-a3b-lora")
    same(lora, apply_lora(model, lora.model.lora))
    # LoRA on the routed experts too: E·r·(in + out) per fused projection, adapters counted among the experts
    experts = load_spec("qwen3-30b-a3b-lora", ["model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,experts]",
                                               "model.lora.dropout=0"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(qwen3)
    same(experts, apply_lora(model, experts.model.lora))
    assert planned_counts(experts).experts_trainable == 48 * 128 * 16 * (2048 + 2 * 768 + 768 + 2048)


# ---- the training forward against transformers' ------------------------------------------------------------
def _batch(seed: int, real: tuple[int, int] = (48, 39)) -> tuple[Batch, torch.Tensor]:
    """Two rows of one document each, the second with a 9-token padding tail (or the `real` lengths), as the loader
    builds them; and the attention mask transformers is given for the same rows."""
    rows, seq, real = 2, 48, torch.tensor(real)
    ids = torch.randint(3, 400, (rows, seq), generator=torch.Generator().manual_seed(seed))
    mask = torch.arange(seq)[None] < real[:, None]
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = torch.where(mask[:, 1:], ids[:, 1:], IGNORE_INDEX)
    positions = torch.arange(seq).repeat(rows, 1)
    for row, length in enumerate(real.tolist()):  # the packer's padding tail: its own span, positions from 0
        positions[row, length:] = torch.arange(seq - length)
    spans = document_spans(positions, real)
    return Batch(ids, labels, positions, int(mask[:, 1:].sum()), int(real.sum()), spans), mask


@pytest.mark.parametrize("name", FAMILIES)
def test_loss_and_every_gradient_equal_transformers_with_the_aux_loss_on_and_off(checkpoints, name):
    """shardline's training forward (per-document SDPA on the loader's rows, router logits recorded by hooks, the
    padding tail left out of the aux loss) against transformers' own loss with labels and an attention mask."""
    batch, mask = _batch(seed=1)
    model, theirs = ours(checkpoints[name]), reference(checkpoints[name])
    for aux in (False, True):
        model.zero_grad(set_to_none=True)
        theirs.zero_grad(set_to_none=True)
        model.config.output_router_logits = aux  # what a config.json with output_router_logits: true says
        assert moe.aux_loss_coefficient(model.config) == (AUX_COEF if aux else 0.0)
        loss = token_loss_sum(model, batch) / batch.n_loss_tokens
        loss.backward()
        out = theirs(input_ids=batch.input_ids, attention_mask=mask.long(),
                     labels=torch.where(mask, batch.input_ids, IGNORE_INDEX), output_router_logits=aux)
        out.loss.backward()
        if aux:  # the auxiliary term is large enough here that leaving it out would fail the oracle
            assert out.aux_loss.item() * AUX_COEF > 1e-3
        grads = {k: p.grad for k, p in theirs.named_parameters()}
        diffs = {k: (p.grad - grads[k]).abs().max().item() for k, p in model.named_parameters()}
        print(f"{name} aux={aux}: loss {loss.item():.7f} vs transformers {out.loss.item():.7f}; every gradient: "
              f"max abs diff {max(diffs.values()):.2e} ({max(diffs, key=diffs.get)})")
        assert loss.item() == pytest.approx(out.loss.item(), rel=1e-6, abs=1e-6)
        assert diffs.keys() == grads.keys()
        for key, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[key], atol=2e-6, rtol=1e-4,
                                       msg=lambda m, k=key, aux=aux: f"aux={aux} {k}: {m}")


def test_the_router_z_loss_is_coef_times_the_mean_square_logsumexp_of_transformers_router_logits(checkpoints):
    """`train.router_z_loss_coef`: the training loss grows by coef · the mean over the real tokens and MoE layers of
    logsumexp(router logits)² (ST-MoE's z-loss), derived here by hand from transformers' own router logits
    (`output_router_logits=True`, the padding tail masked out); its gradient reaches the routers; a dense model
    refuses a coefficient."""
    batch, mask = _batch(seed=3)
    model, theirs = ours(checkpoints["mixtral"]), reference(checkpoints["mixtral"])
    coef = 0.01
    plain = token_loss_sum(model, batch)
    plain.backward()
    router = model.model.layers[0].mlp.gate.weight
    without = router.grad.clone()
    model.zero_grad(set_to_none=True)
    moe.set_z_loss_coefficient(model.config, coef)
    with_z = token_loss_sum(model, batch)
    with_z.backward()
    with torch.no_grad():
        logits = theirs(input_ids=batch.input_ids, attention_mask=mask.long(), output_router_logits=True).router_logits
    keep = mask.reshape(-1)
    z = torch.cat([torch.logsumexp(layer.float(), dim=-1)[keep] for layer in logits]).pow(2).mean()
    added = (with_z - plain).item() / batch.n_loss_tokens
    print(f"router z-loss: shardline adds {added:.7f}, by hand from transformers' router logits {coef * z.item():.7f}")
    assert added == pytest.approx(coef * z.item(), rel=1e-5) and added > 1e-3
    assert (router.grad - without).abs().max() > 1e-4  # the z-loss's gradient reaches the router
    with pytest.raises(SpecError, match="has no router") as e:
        moe.set_z_loss_coefficient(LlamaConfig(), 0.1)
    assert e.value.where == "train.router_z_loss_coef"


def test_mis_routing_moves_the_loss_beyond_the_oracles_tolerance(checkpoints):
    """The oracle's teeth: rolling the experts by one (each token served by its neighbour's weights) or dropping the
    routing weights' normalisation changes the loss far beyond the 1e-6 the oracle allows."""
    batch, _ = _batch(seed=2)
    model = ours(checkpoints["qwen3_moe"])
    with torch.no_grad():
        base = token_loss_sum(model, batch).item() / batch.n_loss_tokens
        for layer in model.model.layers:
            experts = layer.mlp.experts
            experts.gate_up_proj.copy_(experts.gate_up_proj.roll(1, 0))
            experts.down_proj.copy_(experts.down_proj.roll(1, 0))
        rolled = token_loss_sum(model, batch).item() / batch.n_loss_tokens
    print(f"qwen3_moe: experts rolled by one change the loss by {abs(rolled - base) / base:.2e} relative")
    assert abs(rolled - base) / base > 1e-3


def _capped_by_hand(experts: torch.nn.Module, factor: float, dropped: list[int]) -> None:
    """transformers' experts module on the copies within capacity only, chosen here by hand: of each expert's copies
    the ceil(tokens·k / E · factor) of largest routing weight (earlier position first among equal weights) keep their
    weight, the others get 0 (so they add nothing); the copies left out are appended to `dropped`."""
    forward = experts.forward

    def capped(hidden_states, top_k_index, top_k_weights):
        capacity = math.ceil(hidden_states.shape[0] * TOP_K / EXPERTS * factor)
        keep = torch.zeros_like(top_k_index, dtype=torch.bool)
        for e in range(EXPERTS):
            copies = sorted((-top_k_weights[t, j].item(), t, j) for t, j in (top_k_index == e).nonzero().tolist())
            for _, t, j in copies[:capacity]:
                keep[t, j] = True
        dropped.append(int((~keep).sum()))
        return forward(hidden_states, top_k_index, top_k_weights * keep)

    experts.forward = capped


def test_a_capacity_factor_drops_the_lightest_copies_over_capacity_as_transformers_experts_on_the_kept_copies(
        checkpoints):
    """`train.expert_capacity_factor`: each expert takes at most ceil(tokens·k / E · factor) routed copies of a
    forward, the lightest over it dropped. The loss and every gradient equal transformers' model whose experts get the
    kept copies only (chosen by hand, `_capped_by_hand`), and the copies counted as dropped are the ones left out
    there (factor 1 drops; factor E/k, capacity of every token, drops none). No factor: the model is untouched, its
    loss bit-equal to one never given a factor. A dense model refuses a factor, and so does the spec one ≤ 0."""
    # 2 whole rows of 48 positions (a padding tail would be routed, and take capacity, differently in transformers'
    # masked forward): capacity ceil(96 · 2 / 8 · factor) per expert and layer
    batch, _ = _batch(seed=4, real=(48, 48))
    path = checkpoints["qwen3_moe"]
    untouched = ours(path)
    moe.limit_expert_capacity(untouched, None)
    assert all("forward" not in vars(m) for m in moe.expert_modules(untouched))
    assert torch.equal(token_loss_sum(untouched, batch), token_loss_sum(ours(path), batch))
    for factor, drops in ((EXPERTS / TOP_K, False), (1.0, True)):
        model, theirs = ours(path), reference(path)
        moe.limit_expert_capacity(model, factor)
        load = moe.ExpertLoad(model)
        dropped: list[int] = []
        for layer in theirs.model.layers:
            _capped_by_hand(layer.mlp.experts, factor, dropped)
        loss = token_loss_sum(model, batch) / batch.n_loss_tokens
        loss.backward()
        want = theirs(input_ids=batch.input_ids, labels=batch.input_ids).loss
        want.backward()
        counted = int(load.take()[-1])
        grads = {k: p.grad for k, p in theirs.named_parameters()}
        diffs = {k: (p.grad - grads[k]).abs().max().item() for k, p in model.named_parameters()}
        print(f"capacity factor {factor}: capacity {expert_capacity(96, TOP_K, EXPERTS, factor)}, copies dropped "
              f"{counted} (by hand, per layer: {dropped}); loss {loss.item():.6f} vs transformers' on the kept copies "
              f"{want.item():.6f}; every gradient: max abs diff {max(diffs.values()):.2e}")
        assert counted == sum(dropped) and (counted > 0) == drops
        assert loss.item() == pytest.approx(want.item(), rel=1e-6)
        for key, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[key], atol=2e-6, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")
        if drops:  # the oracle has teeth: the dropped copies move the loss
            dropless = token_loss_sum(untouched, batch).item() / batch.n_loss_tokens
            assert abs(loss.item() - dropless) > 1e-3 * loss.item(), (loss.item(), dropless)
            assert load.fields(load.take().tolist())["expert_dropped"] == 0  # taken: counted afresh
    with torch.no_grad():  # forwards without gradients (validation) drop, but do not count
        token_loss_sum(model, batch)
    assert int(load.take()[-1]) == 0
    dense = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(SpecError, match="no routed experts") as e:
        moe.limit_expert_capacity(dense, 1.0)
    assert e.value.where == "train.expert_capacity_factor"
    with pytest.raises(SpecError, match="train.expert_capacity_factor"):
        load_spec("tiny", ["train.expert_capacity_factor=0"])


def _biased_by_hand(router: torch.nn.Module, bias: torch.Tensor, normalise: bool, chosen: list[torch.Tensor]) -> None:
    """transformers' router choosing by hand: the top-k of softmax(logits) + `bias`, weighted by the plain
    probabilities (normalised over the k where the family does); each choice appended to `chosen`."""

    def forward(hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = torch.nn.functional.linear(hidden.reshape(-1, router.weight.shape[1]), router.weight)
        p = torch.softmax(logits.float(), dim=-1)
        index = torch.topk(p + bias, TOP_K, dim=-1).indices
        weights = p.gather(-1, index)
        if normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        chosen.append(index)
        return logits, weights, index

    router.forward = forward


def test_router_biases_steer_the_top_k_choice_but_not_the_weights_and_move_against_the_load(checkpoints):
    """`train.router_bias_update_rate` (auxiliary-loss-free balancing): with biases drawn nonzero, the loss and every
    gradient equal transformers' model whose routers choose, by hand here, the top-k of softmax(logits) + bias and
    weight the choice by the plain probabilities (normalised as the family does: Qwen3-MoE's config says, Mixtral
    always), and the expert load counts the biased choice; the update moves each layer's bias by
    rate · sign(mean − load), centred. A rate of 0 leaves the routers transformers' own; a dense model refuses one."""
    batch, _ = _batch(seed=5, real=(48, 48))
    for name in ("qwen3_moe", "mixtral"):
        model, theirs = ours(checkpoints[name]), reference(checkpoints[name])
        biases = router_bias(model, 0.01)
        load = moe.ExpertLoad(model)
        biases.bias.copy_(torch.randn(biases.bias.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
        chosen: list[torch.Tensor] = []
        for layer, router in enumerate(moe.routers(theirs)):
            _biased_by_hand(router, biases.bias[layer].clone(), getattr(router, "norm_topk_prob", True), chosen)
        loss = token_loss_sum(model, batch) / batch.n_loss_tokens
        loss.backward()
        want = theirs(input_ids=batch.input_ids, labels=batch.input_ids).loss
        want.backward()
        grads = {k: p.grad for k, p in theirs.named_parameters()}
        diffs = {k: (p.grad - grads[k]).abs().max().item() for k, p in model.named_parameters()}
        counted = load.take().view(len(chosen), EXPERTS)
        plain = token_loss_sum(ours(checkpoints[name]), batch).item() / batch.n_loss_tokens
        print(f"{name} with router biases: loss {loss.item():.6f} vs transformers' routers by hand {want.item():.6f} "
              f"(unbiased {plain:.6f}); every gradient: max abs diff {max(diffs.values()):.2e}")
        assert loss.item() == pytest.approx(want.item(), rel=1e-6) and abs(loss.item() - plain) > 1e-4
        for key, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[key], atol=2e-6, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")
        for layer, index in enumerate(chosen):
            assert counted[layer].tolist() == torch.bincount(index.reshape(-1), minlength=EXPERTS).tolist()
    before = biases.bias.clone()
    loads = torch.tensor([[8.0] * 8, [20.0, 0.0, 8.0, 8.0, 8.0, 8.0, 8.0, 4.0]])  # means 8 and 8
    biases.update(loads.reshape(-1))
    sign = torch.tensor([[0.0] * 8, [-1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])  # centred: minus 1/8 each
    assert torch.allclose(biases.bias - before, 0.01 * (sign - sign.mean(dim=1, keepdim=True)), atol=1e-7)
    assert router_bias(ours(checkpoints["qwen3_moe"]), 0.0) is None
    dense = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(SpecError, match="has no router") as e:
        router_bias(dense, 0.001)
    assert e.value.where == "train.router_bias_update_rate"


# ---- the Trainer, one in-process rank -----------------------------------------------------------------------
def _per_document(model: torch.nn.Module, data, rows: list[int]) -> tuple[torch.Tensor, int, tuple]:
    """Summed next-token loss over the documents of packed `rows`, each alone through transformers' model, the
    number of loss tokens, and every MoE layer's router logits over all those documents' tokens."""
    packed = data.rows("train")
    total, count, routed = torch.zeros((), dtype=torch.float64), 0, []
    for r in rows:
        at = 0
        for doc in documents_of_rows(data, [r]):
            ids = torch.tensor([doc])
            keep = torch.tensor(packed.loss_mask[r, at: at + len(doc)], dtype=torch.bool)[None]
            out = model(input_ids=ids, output_router_logits=True)
            labels = torch.where(keep, ids, IGNORE)[0, 1:]
            total = total + torch.nn.functional.cross_entropy(out.logits[0, :-1].float(), labels,
                                                              ignore_index=IGNORE, reduction="sum").double()
            count += int((labels != IGNORE).sum())
            routed.append(out.router_logits)
            at += len(doc)
    return total, count, tuple(torch.cat(layer) for layer in zip(*routed, strict=True))


TRAINED = {"qwen3_moe": False, "qwen2_moe": True}
"""The families trained one step by the Trainer, and whether their config turns the auxiliary loss on."""


@pytest.fixture(scope="module")
def trained(ctx, checkpoints, tok, tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("moe-runs")
    results = {}
    for name, aux in TRAINED.items():
        path = checkpoints[name]
        if aux:  # the checkpoint's config.json turns the router's auxiliary loss on
            path = write_checkpoint(name, tok, root / f"{name}-aux", output_router_logits=True)
        spec, run_dir = create_run(small_spec(root, f"model.path={path}", f"run.id=moe-{name}", *STEP))
        trainer = Trainer(spec, ctx, prepare(spec), run_dir, Console(quiet=True))
        record = trainer.train_step()
        trainer.save_checkpoint()
        rows = [r for line in trainer.sample_trace.read_text().splitlines()[:1] for r in json.loads(line)["rows"]]
        named = dict(trainer.model.named_parameters())
        results[name] = dict(path=path, aux=aux, record=record, rows=rows, trainer=trainer, run_dir=run_dir,
                             expert_placement=named["model.layers.0.mlp.experts.gate_up_proj"].placements,
                             moments={k: _full(trainer.optimizer.state[p]["exp_avg"]) for k, p in named.items()})
    return results


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


@pytest.mark.parametrize("name", list(TRAINED))
def test_one_trainer_step_equals_transformers_on_each_document_alone(name, trained):
    """FSDP2 (one rank) shards the fused experts on the expert dimension; the step's loss is the cross-entropy of
    every packed document alone through transformers (plus coef · aux over all their tokens where the config turns
    it on), and its gradients (the first Adam moments: (1 − β1) · the clipped gradient) are transformers'."""
    got = trained[name]
    assert str(got["expert_placement"]) == "(Shard(dim=0),)"
    plain = AutoModelForCausalLM.from_pretrained(got["path"], dtype=torch.float32, attn_implementation="eager")
    total, count, routed = _per_document(plain, got["trainer"].data, got["rows"])
    loss = total / count
    if got["aux"]:
        loss_func = sys.modules[type(plain).__module__].load_balancing_loss_func
        loss = loss + AUX_COEF * loss_func(routed, EXPERTS, TOP_K)
    assert got["record"].tokens == count
    print(f"{name} (aux {'on' if got['aux'] else 'off'}): shardline {got['record'].loss:.7f} vs transformers "
          f"{loss.item():.7f}")
    assert got["record"].loss == pytest.approx(loss.item(), rel=1e-5)
    loss.backward()
    t = got["trainer"].spec.train
    torch.nn.utils.clip_grad_norm_(list(plain.parameters()), t.max_grad_norm or float("inf"))
    diffs = {}
    for key, p in plain.named_parameters():
        want = (1 - BETAS[0]) * p.grad
        diffs[key] = (got["moments"][key] - want).abs().max().item()
        torch.testing.assert_close(got["moments"][key], want, atol=1e-7, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")
    print(f"{name}: first moments vs (1 − β1)·transformers' clipped gradient: max abs diff {max(diffs.values()):.2e}")


def test_flops_count_the_active_experts(trained):
    """6·N per token with N the active parameters: of each layer's routed experts only top-k of E."""
    trainer = trained["qwen3_moe"]["trainer"]
    config = trainer.model.config
    per_layer = EXPERTS * (2 * 32 * 64 + 64 * 32)  # gate_up [E, 2I, H] + down [E, H, I]
    counts = trainer.params
    assert counts.experts_trainable == config.num_hidden_layers * per_layer
    assert counts.active_trainable == counts.trainable - (1 - TOP_K / EXPERTS) * counts.experts_trainable
    dense = flops_per_token(counts.__class__(counts.trainable, counts.frozen, counts.embedding), 2, 64, 192)
    assert dense - trainer.flops_per_token == pytest.approx(6 * (1 - TOP_K / EXPERTS) * counts.experts_trainable)
    console = trainer.console = Console(record=True, width=400)
    trainer.describe()  # the setup line says what the FLOPs count
    active = counts.trainable - (1 - TOP_K / EXPERTS) * counts.experts_trainable
    said = f"{active / 1e6:.3f}M active per token: {TOP_K / EXPERTS:.0%} of each layer's experts"
    assert said in console.export_text()


def test_export_writes_the_inputs_keys_and_loads_in_transformers_with_shardlines_logits(trained, tmp_path):
    """`shardline export` of the trained run (the DCP checkpoint read into a plain model, saved by transformers):
    the per-expert key set of the input checkpoint, and transformers' model of it computes the trained logits."""
    from shardline.export import export_run

    ids = torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(3))
    for name, got in trained.items():
        out = export_run(got["run_dir"], tmp_path / name)
        assert stored_keys(out) == stored_keys(got["path"]), name
        exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        model = got["trainer"].model.eval()
        with torch.no_grad():
            theirs, ours_ = exported(input_ids=ids).logits, model(input_ids=ids).logits
        model.train()
        print(f"{name}: exported logits vs the trained model's: max abs diff {(theirs - ours_).abs().max():.2e}")
        torch.testing.assert_close(ours_, theirs, atol=1e-5, rtol=1e-5, msg=name)


def test_a_bf16_step_of_the_experts_is_the_fp32_step_to_bf16_precision(ctx, checkpoints, trained, tmp_path):
    """bf16 (the default on GPUs and bf16 CPUs): the fused experts in bf16 compute under FSDP's mixed precision,
    fp32 master weights; the step's loss and gradient norm are the fp32 step's to bf16's precision."""
    spec, run_dir = create_run(small_spec(tmp_path, f"model.path={checkpoints['qwen3_moe']}", "run.id=moe-bf16",
                                          *STEP, "train.precision=bf16"))
    trainer = Trainer(spec, ctx, prepare(spec), run_dir, Console(quiet=True))
    record, fp32 = trainer.train_step(), trained["qwen3_moe"]["record"]
    print(f"bf16 vs fp32 step: loss {record.loss:.5f} vs {fp32.loss:.5f}, grad norm {record.grad_norm:.4f} vs "
          f"{fp32.grad_norm:.4f}")
    assert trainer.model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32  # the master weights
    assert record.loss == pytest.approx(fp32.loss, rel=2e-2)
    assert record.grad_norm == pytest.approx(fp32.grad_norm, rel=5e-2)


# ---- LoRA ---------------------------------------------------------------------------------------------------
def test_lora_trains_attention_with_the_experts_and_router_frozen(ctx, checkpoints, tmp_path):
    path = checkpoints["qwen3_moe"]
    spec, run_dir = create_run(small_spec(tmp_path, f"model.path={path}", "run.id=moe-lora", *STEP,
                                          "model.lora.enabled=true", "model.lora.r=4", "train.lr=1e-2",
                                          "train.precision=bf16"))  # LoRA's default precision
    trainer = Trainer(spec, ctx, prepare(spec), run_dir, Console(quiet=True))
    before = {k: _full(p) for k, p in trainer.model.named_parameters()}
    trainable = sorted(k for k, p in trainer.model.named_parameters() if p.requires_grad)
    assert trainable and all(".lora_" in k and "self_attn" in k for k in trainable)
    trainer.train_step()
    changed = sorted(k for k, p in trainer.model.named_parameters() if not torch.equal(_full(p), before[k]))
    assert changed and all(".lora_B" in k or ".lora_A" in k for k in changed)
    assert not any("experts" in k or "mlp.gate" in k for k in changed)

    model = build_model(ModelSpec(path=str(path)), 0, {}, device="meta")
    for targets in (["gate_up_proj"], ["q_proj", "down_proj"], ["gate"]):
        with pytest.raises(SpecError, match="experts' projections one by one is not supported, and the router") as e:
            apply_lora(model, LoraSpec(enabled=True, target_modules=targets))
        assert e.value.where == "model.lora.target_modules" and "add experts" in e.value.fix
    with pytest.raises(SpecError, match="is 0.1 with experts in model.lora.target_modules") as e:
        apply_lora(model, LoraSpec(enabled=True, dropout=0.1, target_modules=["q_proj", "experts"]))
    assert e.value.where == "model.lora.dropout"
    with pytest.raises(SpecError, match="nf4 with a mixture of experts"):
        quantize_frozen_base(model, LoraSpec(enabled=True, quantize_base="nf4"), "bf16")


@torch.no_grad()
def _trained_logits(model: torch.nn.Module, path: Path, run_dir: Path, tmp_path: Path,
                    *switches) -> tuple[torch.Tensor, ...]:
    """Logits of one batch: the trained model's, the input checkpoint's (transformers), the model's with every adapter
    off (DPO's reference: the experts' and routers' too) and inside each of `switches`, then the run's merged and
    adapter exports' (`_exported_logits`)."""
    ids = torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(3))
    model.eval()
    try:
        switched = []
        for switch in (adapters_off, *switches):
            with switch(model):
                switched.append(model(input_ids=ids).logits)
        return (model(input_ids=ids).logits, reference(path)(input_ids=ids).logits, *switched,
                *_exported_logits(run_dir, path, ids, tmp_path))
    finally:
        model.train()


def _exported_logits(run_dir: Path, path: Path, ids: torch.Tensor, tmp_path: Path) -> tuple[torch.Tensor, ...]:
    """The logits of the run's merged export (transformers' model of it, stored in the input's key layout) and of
    its adapter export (peft's, loaded onto transformers' model of the input)."""
    from peft import PeftModel

    from shardline.export import export_run

    merged = AutoModelForCausalLM.from_pretrained(export_run(run_dir, tmp_path / "merged", merge_lora=True),
                                                  dtype=torch.float32)
    assert stored_keys(tmp_path / "merged") == stored_keys(path)
    peft = PeftModel.from_pretrained(reference(path), export_run(run_dir, tmp_path / "adapter")).eval()
    return merged(input_ids=ids).logits, peft(input_ids=ids).logits


@pytest.mark.parametrize("targets", [["q_proj", "v_proj", "experts"], ["experts"]])
def test_lora_on_the_experts_trains_adapters_only_and_exports_merged_and_as_peft_with_the_trained_logits(
        ctx, checkpoints, tmp_path, targets):
    """`experts` among the targets: adapters per expert on both fused projections (`[E, r, in]`, `[E, out, r]`), the
    router and every base weight frozen; after two steps only adapters changed (the experts' lora_A and lora_B too),
    the merged export (transformers' model of it) and the adapter export (peft's `target_parameters` layout, loaded
    with `PeftModel.from_pretrained` onto transformers' model of the input) compute the trained model's logits; with
    the adapters off (DPO's reference) the model computes the base's."""
    path = checkpoints["mixtral"]
    spec, run_dir = create_run(small_spec(tmp_path, f"model.path={path}", "run.id=moe-expert-lora", *STEP,
                                          "train.max_steps=2", "model.lora.enabled=true", "model.lora.r=4",
                                          f"model.lora.target_modules=[{','.join(targets)}]", "train.lr=1e-2"))
    trainer = Trainer(spec, ctx, prepare(spec), run_dir, Console(quiet=True))
    before = {k: _full(p) for k, p in trainer.model.named_parameters()}
    trainable = sorted(k for k, p in trainer.model.named_parameters() if p.requires_grad)
    assert all(".lora_" in k for k in trainable) and not any("mlp.gate" in k for k in trainable)
    adapter = dict(trainer.model.named_parameters())[next(k for k in trainable if k.endswith(
        "layers.0.mlp.experts.lora_B.gate_up_proj"))]
    assert adapter.shape == (EXPERTS, 2 * 32, 4) and str(adapter.placements) == "(Shard(dim=0),)"
    # FLOPs count the experts' adapters as active for k of E experts, as their weights: 2 layers × E × r ×
    # (H + 2I for gate_up_proj, I + H for down_proj)
    assert trainer.params.experts_trainable == 2 * EXPERTS * 4 * (64 + 2 * 32 + 32 + 64)
    first, second = trainer.train_step(), trainer.train_step()
    changed = sorted(k for k, p in trainer.model.named_parameters() if not torch.equal(_full(p), before[k]))
    assert set(changed) == set(trainable), sorted(set(trainable) - set(changed))
    print(f"LoRA on {targets}: losses {first.loss:.5f}, {second.loss:.5f}; {len(changed)} adapter tensors changed")
    trainer.save_checkpoint()

    ours_, base, off, merged_logits, peft_logits = _trained_logits(trainer.model, path, run_dir, tmp_path)
    print(f"trained logits vs the base's: max abs diff {(ours_ - base).abs().max():.2e}; vs the merged export's "
          f"{(ours_ - merged_logits).abs().max():.2e}; vs peft's adapter {(ours_ - peft_logits).abs().max():.2e}")
    assert (ours_ - base).abs().max() > 1e-2  # the adapters moved the logits
    torch.testing.assert_close(off, base, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_logits, ours_, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(peft_logits, ours_, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("name", "targets"), [("qwen3_moe", ["q_proj", "v_proj", "router"]),
                                               ("mixtral", ["router", "experts"])])
def test_lora_on_the_router_trains_adapters_only_and_exports_merged_and_as_peft_with_the_trained_logits(
        ctx, checkpoints, tmp_path, name, targets):
    """`router` among the targets (opt-in: the router is frozen without it): every router gets `lora_A [r, H]` and
    `lora_B [E, r]`; after two steps only adapters changed (the routers' weights not), the planner counts the
    trainer's trainable parameters, the merged export (transformers' model of it) and the adapter export (peft's
    `target_parameters` on `mlp.gate.weight`, loaded by `PeftModel.from_pretrained` onto transformers' model of the
    input) compute the trained model's logits, and with the adapters off (DPO's reference) the model is the base."""
    from shardline.planning.step_time import planned_counts

    path = checkpoints[name]
    spec, run_dir = create_run(small_spec(tmp_path, f"model.path={path}", f"run.id=moe-router-lora-{name}", *STEP,
                                          "train.max_steps=2", "model.lora.enabled=true", "model.lora.r=4",
                                          f"model.lora.target_modules=[{','.join(targets)}]", "train.lr=5e-2"))
    trainer = Trainer(spec, ctx, prepare(spec), run_dir, Console(quiet=True))
    before = {k: _full(p) for k, p in trainer.model.named_parameters()}
    trainable = sorted(k for k, p in trainer.model.named_parameters() if p.requires_grad)
    routers = [k for k in trainable if ".mlp.gate.lora_" in k]
    assert all(".lora_" in k for k in trainable) and len(routers) == 2 * 2  # 2 layers × (A, B)
    assert dict(trainer.model.named_parameters())[routers[0]].shape in ((4, 64), (EXPERTS, 4))
    assert planned_counts(spec).trainable == trainer.params.trainable
    trainer.train_step(), trainer.train_step()
    changed = sorted(k for k, p in trainer.model.named_parameters() if not torch.equal(_full(p), before[k]))
    assert set(changed) == set(trainable), sorted(set(trainable) - set(changed))
    trainer.save_checkpoint()

    # with the routers' adapters off (the other adapters on): what the routers' adapters add
    ours_, base, off, unrouted, merged_logits, peft_logits = _trained_logits(trainer.model, path, run_dir, tmp_path,
                                                                             router_adapters_off)
    print(f"{name}, LoRA on {targets}: trained logits vs the base's: max abs diff {(ours_ - base).abs().max():.2e}; "
          f"vs the routers' adapters off {(ours_ - unrouted).abs().max():.2e}; vs the merged export's "
          f"{(ours_ - merged_logits).abs().max():.2e}; vs peft's adapter "
          f"{(ours_ - peft_logits).abs().max():.2e}")
    assert (ours_ - base).abs().max() > 1e-2 and (ours_ - unrouted).abs().max() > 1e-2
    torch.testing.assert_close(off, base, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_logits, ours_, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(peft_logits, ours_, atol=1e-5, rtol=1e-5)


def test_the_experts_run_as_one_grouped_matmul_per_projection_equal_to_the_loop_over_experts(monkeypatch):
    """run_experts (expert parallel's and the expert adapters' forward): on CPU with 16-byte rows, torch's grouped
    matmul, one call per projection and adapter factor, with an expert that got no token; values and every gradient
    equal the loop over experts in fp32. Misaligned rows fall back to the loop."""
    torch.manual_seed(0)
    experts, hidden, inter, rank = 4, 16, 24, 8
    module = torch.nn.Module()
    module.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * inter, hidden))
    module.down_proj = torch.nn.Parameter(torch.randn(experts, hidden, inter))
    module.act_fn = torch.nn.SiLU()
    module.lora_A = torch.nn.ParameterDict({"gate_up_proj": torch.randn(experts, rank, hidden),
                                            "down_proj": torch.randn(experts, rank, inter)})
    module.lora_B = torch.nn.ParameterDict({"gate_up_proj": torch.randn(experts, 2 * inter, rank),
                                            "down_proj": torch.randn(experts, hidden, rank)})
    module.lora_scaling = 0.5
    per_expert = [3, 0, 5, 2]
    rows = torch.randn(sum(per_expert), hidden, requires_grad=True)
    params = [rows, *module.parameters()]
    calls = []
    grouped_mm = torch.nn.functional.grouped_mm
    monkeypatch.setattr(torch.nn.functional, "grouped_mm", lambda *a, **k: calls.append(1) or grouped_mm(*a, **k))

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = moe.run_experts(module, rows, per_expert, torch.tensor(per_expert))
        grads = torch.autograd.grad(out.sum(), params)  # an expanded gradient: the grouped backward needs it whole
        return out, grads

    grouped, grouped_grads = run()
    assert len(calls) == 6  # gate_up, down, and each one's two adapter factors
    monkeypatch.setattr(moe, "grouped_matmul_runs", lambda rows, weights: False)
    looped, looped_grads = run()
    assert len(calls) == 6
    torch.testing.assert_close(grouped, looped, rtol=0, atol=0)
    for a, b in zip(grouped_grads, looped_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not moe.grouped_matmul_runs(rows, [torch.randn(experts, 2 * inter, hidden + 1)])
