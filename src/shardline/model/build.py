"""Build the model: a Llama-architecture config (random init) or a local/hub HF checkpoint.

Model code stays plain single-device PyTorch (HF transformers); parallelism is applied afterwards by
`shardline.train.parallelize`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from shardline.errors import SpecError
from shardline.spec import ModelSpec


def llama_config(spec: ModelSpec, vocab_size: int, special_ids: dict[str, int]) -> LlamaConfig:
    a = spec.arch
    return LlamaConfig(
        vocab_size=max(a.vocab_size, vocab_size),
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        max_position_embeddings=a.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta},
        tie_word_embeddings=a.tie_embeddings,
        attn_implementation=spec.attn_implementation,
        use_cache=False,
        **special_ids,
    )


def build_model(spec: ModelSpec, vocab_size: int, special_ids: dict[str, int]) -> nn.Module:
    """fp32 master weights on CPU; mixed precision is applied by the sharding policy."""
    if spec.path is None:
        torch.manual_seed(spec.init_seed)
        return LlamaForCausalLM(llama_config(spec, vocab_size, special_ids))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            spec.path, dtype=torch.float32, attn_implementation=spec.attn_implementation
        )
    except OSError as e:
        raise SpecError("model.path", f"cannot load {spec.path!r} ({str(e)[:200]})",
                        "point it at a local directory with config.json and *.safetensors") from e
    if model.get_input_embeddings().num_embeddings < vocab_size:
        raise SpecError("model.tokenizer", f"tokenizer has {vocab_size} tokens, more than the model's "
                        f"{model.get_input_embeddings().num_embeddings} embeddings", "use the model's own tokenizer")
    model.config.use_cache = False
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated transformer blocks (works through a peft wrapper)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers
