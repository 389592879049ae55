"""Build the model on the meta device: a Llama-architecture config (random init) or a local/hub HF checkpoint.

Model code stays plain single-device PyTorch (HF transformers); parallelism is applied afterwards by
`shardline.parallel.fsdp`, and only then are the weights materialised, each rank holding just its own
shards (`shardline.model.sharded_load.materialize`). A plain single-process model (export, tests) is the same
meta build materialised whole on one device, so both paths give the same weights.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig

from shardline.errors import SpecError
from shardline.model import document_attention
from shardline.model.families import family_of, language_model_config
from shardline.model.sharded_load import materialize
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


def model_config(spec: ModelSpec, vocab_size: int, special_ids: dict[str, int]) -> PretrainedConfig:
    """`model.path`'s config.json (its own special ids; a multimodal checkpoint's language model), else the
    config of `model.arch`; KV cache off."""
    if spec.path is None:
        return llama_config(spec, vocab_size, special_ids)
    try:
        config = AutoConfig.from_pretrained(spec.path)
    except OSError as e:
        raise SpecError("model.path", f"cannot load {spec.path!r} ({str(e)[:200]})",
                        "point it at a local directory with config.json and *.safetensors") from e
    config = language_model_config(config)  # Gemma 3 4B+: the language model of the multimodal checkpoint
    family_of(config)  # mixture-of-experts, encoder-decoders, vision models: a named error listing what trains
    if config.vocab_size < vocab_size:
        raise SpecError("model.tokenizer", f"tokenizer has {vocab_size} tokens, more than the model's "
                        f"{config.vocab_size} embeddings", "use the model's own tokenizer")
    config.use_cache = False
    return config


def build_model(spec: ModelSpec, vocab_size: int, special_ids: dict[str, int],
                device: str | torch.device = "cpu") -> nn.Module:
    """The causal LM with fp32 parameters; mixed precision is applied by the sharding policy.

    `device="meta"` allocates nothing: apply LoRA and parallelism, then call `materialize` to fill each rank's
    shards. Any other device returns the whole model there, materialised the same way (checkpoint weights, or
    the deterministic random init of `model.init_seed`).
    """
    config = model_config(spec, vocab_size, special_ids)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=hf_attention(spec.attn_implementation),
                                                 dtype=torch.float32)
    if torch.device(device).type != "meta":
        materialize(model, spec, torch.device(device))
    return model


def hf_attention(name: str) -> str:
    """The transformers attention implementation for `model.attn_implementation`: `sdpa` is SDPA per
    document on packed rows (`shardline.model.document_attention`), plain SDPA everywhere else."""
    if name == "sdpa":
        document_attention.register()
        return document_attention.NAME
    return name


def causal_lm(model: nn.Module) -> nn.Module:
    """The Hugging Face causal LM itself: `model`, or the model inside a peft wrapper.

    peft injects its adapters into this module's layers in place and reaches it through `__call__` for both
    `forward` and `generate`, so module hooks placed on it (FSDP's root all-gather) run on every path.
    """
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated transformer blocks (works through a peft wrapper)."""
    return causal_lm(model).model.layers
