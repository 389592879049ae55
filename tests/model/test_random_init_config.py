"""`model.random_init`: a config.json alone builds a same-shape model with the random init of `model.arch`."""

from pathlib import Path

import pytest
import torch
from transformers import MixtralConfig, Qwen2Config, Qwen3MoeConfig

from shardline.errors import SpecError
from shardline.model.build import build_model, llama_config
from shardline.spec import ModelSpec
from shardline.spec.resolve import load_spec

IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
ARCH = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 160, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2, "max_position_embeddings": 256}


def test_a_config_only_directory_builds_with_the_weights_model_arch_would_draw(tmp_path: Path):
    arch = ModelSpec(arch=ARCH, init_seed=7)
    llama_config(arch, 0, IDS).save_pretrained(tmp_path)  # config.json and nothing else
    from_config = build_model(ModelSpec(path=str(tmp_path), random_init=True, init_seed=7), 0, IDS)
    from_arch = build_model(arch, 0, IDS)
    assert from_config.state_dict().keys() == from_arch.state_dict().keys()
    for name, value in from_arch.state_dict().items():
        assert torch.equal(from_config.state_dict()[name], value), name


def test_a_config_only_qwen2_directory_trains_its_family_layout(tmp_path: Path):
    Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256).save_pretrained(tmp_path)
    model = build_model(ModelSpec(path=str(tmp_path), random_init=True), 0, IDS)
    attention = model.model.layers[0].self_attn
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert attention.q_proj.bias is not None and attention.o_proj.bias is None
    assert model(input_ids=torch.arange(16)[None]).logits.isfinite().all()


@pytest.mark.parametrize("config", [
    Qwen3MoeConfig(vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)], ids=["qwen3_moe", "mixtral"])
def test_a_config_only_mixture_of_experts_draws_its_fused_experts_and_routers_as_transformers_does(tmp_path, config):
    # transformers' _init_weights of these families: normal(0, initializer_range) for the fused experts [E, out, in]
    # and the router; a router left at zero would send every token to the same top-k experts
    config.save_pretrained(tmp_path)
    model = build_model(ModelSpec(path=str(tmp_path), random_init=True), 0, IDS)
    block = model.model.layers[0].mlp
    for weight in (block.experts.gate_up_proj, block.experts.down_proj, block.gate.weight):
        assert weight.std().item() == pytest.approx(config.initializer_range, rel=0.1)
    assert model(input_ids=torch.arange(16)[None]).logits.isfinite().all()


def test_without_random_init_a_config_only_directory_is_a_spec_error_naming_model_path(tmp_path: Path):
    llama_config(ModelSpec(arch=ARCH), 0, IDS).save_pretrained(tmp_path)
    with pytest.raises(SpecError, match="model.path"):
        build_model(ModelSpec(path=str(tmp_path)), 0, IDS)


def test_random_init_without_model_path_is_a_spec_error_naming_it():
    with pytest.raises(SpecError, match="model.random_init"):
        load_spec("tiny", ["model.random_init=true"])
