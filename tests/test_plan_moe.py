"""`shardline plan` of a mixture of experts (issue 55): the Qwen3-30B-A3B presets fit with a stated EP, the formula
and the routing the plan assumes; the experts are gathered by EP shard; the headroom for unbalanced routing is where
the plan stops fitting; what the planner does not size is named. (Parameter counts against transformers' models:
tests/model/test_moe.py; the dry run of expert parallel against the plan: tests/train/test_dry_run.py.)"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

from shardline.cli import main
from shardline.errors import SpecError
from shardline.planning.advice import imbalance_headroom
from shardline.planning.devices import get_device
from shardline.planning.fixes import fixes
from shardline.planning.memory import _from_config, model_shape, param_budget, plan_memory, shape_config
from shardline.spec.resolve import load_spec


def test_plan_of_the_qwen3_30b_a3b_presets_fits_with_a_stated_ep_the_formula_and_the_routing_assumed(capsys,
                                                                                                     monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["plan", "qwen3-30b-a3b"]) == 0
    out = capsys.readouterr().out
    assert "8 × H100 80GB" in out and "FSDP ×8 (EP 8 × efsdp 1)" in out and "fits:" in out
    assert "30.5B in all, 3.35B active per token (top-8 of 128 routed experts" in out
    assert "16 per EP rank (ep 8)" in out and "assume balanced routing" in out
    assert "(6·N_trainable + 4·N_frozen)·tokens" in out
    # (2 + 4) B × 128 experts × 8192 tokens; send and receive of 8192 × 8 copies of 2048 bf16 values
    assert "router logits and probabilities 6 MiB" in out and "all-to-all buffers 512 MiB" in out
    assert main(["plan", "qwen3-30b-a3b-lora"]) == 0
    out = capsys.readouterr().out
    assert "1 × H100 80GB" in out and "fits:" in out and "no expert parallel" in out


def test_expert_parallel_gathers_a_ranks_own_experts_and_shards_the_state_like_fsdp():
    """EP changes what a rank gathers (a block's non-expert weights and its E/ep experts), not its shards."""
    spec = load_spec("qwen3-30b-a3b")
    without = load_spec("qwen3-30b-a3b", ["parallel.ep=1"])
    shape = model_shape(spec.model)
    pb = param_budget(shape, spec.model.lora)
    experts = 3 * 128 * 2048 * 768
    ep8, ep1 = plan_memory(spec, "h100"), plan_memory(without, "h100")
    assert (ep8.params, ep8.grads, ep8.optimizer) == (ep1.params, ep1.grads, ep1.optimizer)
    assert ep1.params == 4 * pb.total / 8
    assert ep1.moment_bytes["optimizer step"] == ep8.moment_bytes["optimizer step"]
    # two blocks gathered at the end of backward: all 128 experts at ep 1, 16 at ep 8 (bf16); EP's all-to-all
    # buffers are far smaller than the 112 experts of each block it does not gather
    assert ep1.moment_bytes["end of backward"] - ep8.moment_bytes["end of backward"] > 2 * 2 * experts * 7 // 8 * 0.9


def test_the_headroom_for_unbalanced_routing_is_where_the_plan_stops_fitting():
    spec = load_spec("qwen3-30b-a3b", ["launch.nnodes=2", "parallel.activation_checkpointing=selective"])
    h100 = get_device("h100")
    headroom = imbalance_headroom(spec, h100, 8.0)
    assert 1.0 < headroom < 8.0
    assert plan_memory(spec, h100, imbalance=headroom).fits
    assert not plan_memory(spec, h100, imbalance=headroom + 0.02).fits
    # with full AC only one block's routed copies are alive: it fits even if one rank computed all of them
    assert imbalance_headroom(load_spec("qwen3-30b-a3b"), h100, 8.0) == 8.0


def test_a_capacity_factor_bounds_the_routed_copies_the_plan_sizes_and_the_plan_says_so(capsys, monkeypatch):
    """With `train.expert_capacity_factor` f an EP rank computes at most E·C copies (C = ceil(N·k/E·f), the
    trainer's `expert_capacity`), whatever the routing: the plan is the unbalanced plan at that share, below the
    balanced one for f < 1, and past the headroom for imbalance it stops fitting; the plan's text names the bound."""
    from shardline.model.moe import expert_capacity

    sets = ["launch.nnodes=2", "parallel.activation_checkpointing=selective"]
    spec, h100 = load_spec("qwen3-30b-a3b", sets), get_device("h100")
    headroom = imbalance_headroom(spec, h100, 8.0)
    n, e, k = spec.train.micro_batch_size * spec.train.seq_len, 128, 8
    for factor in (0.5, 1.25, headroom + 0.1):
        capped = load_spec("qwen3-30b-a3b", [*sets, f"train.expert_capacity_factor={factor}"])
        share = e * expert_capacity(n, k, e, factor) / (n * k)
        planned = plan_memory(capped, h100)
        assert planned.total_bytes == plan_memory(spec, h100, imbalance=share).total_bytes, factor
        assert planned.fits == (share <= headroom)  # the bound is planned, not balanced routing
    half = plan_memory(load_spec("qwen3-30b-a3b", [*sets, "train.expert_capacity_factor=0.5"]), h100)
    assert half.total_bytes < plan_memory(spec, h100).total_bytes
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["plan", "qwen3-30b-a3b", "--set", "train.expert_capacity_factor=1.25"]) == 0
    out = capsys.readouterr().out
    # 2 × 4096 tokens × top-8 / 128 experts × 1.25 = 640 copies per expert; 128 × 640 = 81,920 per EP rank
    assert "capacity factor 1.25 (train.expert_capacity_factor): each expert takes at most 640 routed copies" in out
    assert "computes at most 81,920 (1.25× the balanced 65,536); this plan sizes" in out
    assert "assume balanced routing" not in out
    # send 1× and receive 1.25× of 65,536 copies of 2048 bf16 values
    assert "all-to-all buffers 576 MiB" in out


def test_no_qlora_is_suggested_for_a_mixture_and_dense_layers_are_named(tmp_path):
    spec = load_spec("qwen3-30b-a3b-lora", ["parallel.activation_checkpointing=none"])
    found = fixes(spec, "h100")
    assert found and "QLoRA" not in [f.kind for f in found]
    config = Qwen3MoeConfig(num_hidden_layers=4, mlp_only_layers=[0]).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecError, match="mlp_only_layers") as e:
        model_shape(load_spec("tiny", [f"model.path={tmp_path}"]).model)
    assert e.value.where == "model.path"


@pytest.mark.parametrize("config_class", [MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig])
def test_a_mixtures_shape_round_trips_through_the_config_the_dry_run_builds(config_class):
    """A hub model the planner knows offline is built by the dry run from `shape_config`: each family's expert
    fields (its count and intermediate-size names, a shared expert) come back as the planner read them."""
    shape = _from_config(config_class(num_hidden_layers=2).to_dict())
    again = _from_config(shape_config(shape).to_dict())
    assert replace(again, head_dim=None) == replace(shape, head_dim=None) and again.hd == shape.hd and shape.moe
