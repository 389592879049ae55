"""`model.random_init`: a config.json alone builds a same-shape model with the random init of `model.arch`."""

from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config

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


def test_without_random_init_a_config_only_directory_is_a_spec_error_naming_model_path(tmp_path: Path):
    llama_config(ModelSpec(arch=ARCH), 0, IDS).save_pretrained(tmp_path)
    with pytest.raises(SpecError, match="model.path"):
        build_model(ModelSpec(path=str(tmp_path)), 0, IDS)


def test_random_init_without_model_path_is_a_spec_error_naming_it():
    with pytest.raises(SpecError, match="model.random_init"):
        load_spec("tiny", ["model.random_init=true"])
