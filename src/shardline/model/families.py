"""The decoder families shardline is tested with, read from a checkpoint's own config (a dict or a
transformers config): which family it is, what it adds to Llama's math, and its default LoRA targets.

Models are always transformers' own classes built from the config; this module only names what the planner,
the FLOP count and LoRA need to know, and refuses what shardline cannot train (the mixture-of-experts families
outside Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE, encoder-decoders, vision towers) with the list of what it can.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shardline.errors import SpecError

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
FUSED_ATTENTION = ("qkv_proj", "o_proj")


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    lora_targets: tuple[str, ...]
    """Default `model.lora.target_modules`: the attention projections, fused where the family fuses them."""
    adds: str
    """What the family changes against Llama, as `plan` and the docs say it."""
    fused: bool = False
    """q/k/v in one `qkv_proj`, gate/up in one `gate_up_proj` (Phi-3/Phi-4)."""
    qkv_bias: bool = False
    qk_norm: bool = False
    qk_norm_whole: bool = False
    """QK-norm over the whole q and k projections (OLMoE), not over each head's head_dim."""
    sandwich_norms: bool = False
    """Norms before and after attention and MLP (Gemma 2/3): four per block instead of two."""
    experts: bool = False
    """A mixture of experts: routed experts held fused (`mlp.experts.gate_up_proj [E, 2I, H]`,
    `shardline.model.moe`)."""
    tested: bool = True


FAMILIES: tuple[Family, ...] = (
    Family("Llama", ("llama",), ATTENTION, "the reference layout (Llama 2/3.x, SmolLM)"),
    Family("Qwen2", ("qwen2",), ATTENTION, "q/k/v biases; sliding window on the layers its config names",
           qkv_bias=True),
    Family("Qwen3", ("qwen3",), ATTENTION, "QK-norm; head_dim independent of hidden size", qk_norm=True),
    Family("Mistral", ("mistral",), ATTENTION, "sliding-window attention on every layer"),
    Family("Gemma 2", ("gemma2",), ATTENTION, "attention and final logit soft-capping, alternating sliding/global "
           "layers, pre+post norms, scaled and tied embeddings", sandwich_norms=True),
    Family("Gemma 3", ("gemma3_text",), ATTENTION, "QK-norm, local/global layers, pre+post norms, scaled and tied "
           "embeddings", qk_norm=True, sandwich_norms=True),
    Family("Phi-3", ("phi3",), FUSED_ATTENTION, "fused qkv_proj and gate_up_proj (Phi-3 and Phi-4)", fused=True),
    Family("Qwen3-MoE", ("qwen3_moe",), ATTENTION, "Qwen3's attention; top-k routed experts in every sparse layer",
           qk_norm=True, experts=True),
    Family("Qwen2-MoE", ("qwen2_moe",), ATTENTION, "q/k/v biases; top-k routed experts beside a shared expert "
           "behind a sigmoid gate", qkv_bias=True, experts=True),
    Family("Mixtral", ("mixtral",), ATTENTION, "Mistral's attention; top-2 routed experts (hub keys under "
           "block_sparse_moe, w1/w3/w2)", experts=True),
    Family("OLMoE", ("olmoe",), ATTENTION, "QK-norm over the whole projections; top-k routed experts",
           qk_norm=True, qk_norm_whole=True, experts=True),
)
LLAMA = FAMILIES[0]
BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
SUPPORTED = ", ".join(f"{f.name} ({'/'.join(f.model_types)})" for f in FAMILIES)
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts")
"""Where the configs of the trained mixtures keep their number of routed experts (`shardline.model.moe`, the
planner)."""
EXPERTS_TARGET = "experts"
"""The name in `model.lora.target_modules` that adapts the routed experts (the module transformers calls so;
`shardline.model.expert_lora`, the planner)."""


def expert_capacity(tokens: int, top_k: int, experts: int, factor: float) -> int:
    """The most routed copies one expert takes of `tokens` tokens' top-k copies under `train.expert_capacity_factor`
    (the trainer's `moe.within_capacity`, the planner's `capacity_share`): Megatron-Core's `get_capacity(tokens ·
    top_k, experts, factor)`, ceil(tokens·k / E · factor)."""
    return math.ceil(tokens * top_k / experts * factor)


ROUTER_TARGET = "router"
"""The name in `model.lora.target_modules` that adapts every MoE layer's router (opt-in: frozen by default;
`shardline.model.router_lora`, the planner)."""
_EXPERT_FIELDS = (*EXPERT_COUNT_FIELDS, "n_routed_experts", "moe_num_experts")
TRAINED_EXPERTS = ", ".join(f.name for f in FAMILIES if f.experts)
REFUSED_EXPERTS = {
    "gpt_oss": "gpt-oss is not laid out like the trained mixtures: attention sinks that SDPA does not take, experts "
               "stored [E, H, 2I] with biases and gate/up interleaved, a clamped SwiGLU and MXFP4 hub weights",
    "deepseek_v3": "DeepSeek-V3's multi-head latent attention (MLA) and its grouped, bias-corrected routing are not "
                   "implemented",
    "llama4": "Llama 4 interleaves dense and MoE layers with chunked attention, and its checkpoints are multimodal",
    "llama4_text": "Llama 4 interleaves dense and MoE layers with chunked attention, and its checkpoints are "
                   "multimodal",
}
"""Mixture-of-experts families refused by name, and why."""


MULTIMODAL_LANGUAGE_MODELS = {"gemma3": "gemma3_text"}
"""Multimodal checkpoints whose language model shardline trains alone (the vision tower is not loaded)."""
_LANGUAGE_MODEL_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                            "language_model.lm_head.": "lm_head."}


def language_model_config(config: Any) -> Any:
    """The text model's config of a multimodal checkpoint shardline trains the language model of (Gemma 3 4B
    and larger); any other config unchanged. The outer config's special token ids fill the ones it lacks."""
    if getattr(config, "model_type", None) not in MULTIMODAL_LANGUAGE_MODELS:
        return config
    text = config.text_config
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(text, key, None) is None and getattr(config, key, None) is not None:
            setattr(text, key, getattr(config, key))
    return text


def language_model_key(key: str) -> str | None:
    """A multimodal checkpoint's tensor name as the text model names it; None for the vision tower and the
    projector (not loaded)."""
    for prefix, plain in _LANGUAGE_MODEL_PREFIXES.items():
        if key.startswith(prefix):
            return plain + key.removeprefix(prefix)
    return key if key.startswith("lm_head.") else None


def is_multimodal_checkpoint(keys: Any) -> bool:
    return any(k.startswith(tuple(_LANGUAGE_MODEL_PREFIXES)) for k in keys)


def _as_dict(config: Any) -> dict:
    return config if isinstance(config, dict) else config.to_dict()


def family_of(config: Any, where: str = "model.path") -> Family:
    """The family of a config; an untested decoder-only type plans as Llama and says so (`tested=False`).
    Mixture-of-experts configs outside the four trained families (gpt-oss, DeepSeek-V3 and Llama 4 with their
    reasons), encoder-decoder and multimodal configs are a `SpecError` naming what is supported."""
    cfg = _as_dict(config)
    model_type = str(cfg.get("model_type", ""))
    if model_type in MULTIMODAL_LANGUAGE_MODELS and "text_config" in cfg:
        return BY_MODEL_TYPE[MULTIMODAL_LANGUAGE_MODELS[model_type]]  # its language model is what trains
    refused = None
    if cfg.get("is_encoder_decoder"):
        refused = "an encoder-decoder"
    elif model_type in REFUSED_EXPERTS:
        raise SpecError(where, f"{model_type} is a mixture-of-experts model shardline does not train: "
                        f"{REFUSED_EXPERTS[model_type]}", f"the mixtures that train: {TRAINED_EXPERTS}; "
                        f"dense: {SUPPORTED}")
    elif model_type in BY_MODEL_TYPE and BY_MODEL_TYPE[model_type].experts:
        return BY_MODEL_TYPE[model_type]
    elif any(section.get(k) for section in (cfg, *(v for v in cfg.values() if isinstance(v, dict)))
             for k in _EXPERT_FIELDS):  # also a nested block's experts (DBRX: ffn_config.moe_num_experts)
        refused = f"a mixture-of-experts model of an untested family (the mixtures that train: {TRAINED_EXPERTS})"
    elif "vision_config" in cfg or "text_config" in cfg:
        refused = "a multimodal model (a vision tower beside the language model)"
    if refused:
        raise SpecError(where, f"{model_type or 'the checkpoint'} is {refused}, which shardline does not train",
                        f"use a decoder-only causal LM of a tested family: {SUPPORTED}")
    if model_type in BY_MODEL_TYPE:
        return BY_MODEL_TYPE[model_type]
    return Family(f"{model_type or 'unknown'} (untested; planned as Llama)", (model_type,), ATTENTION,
                  "not among the tested families: the planner assumes Llama's layout", tested=False)


def is_tested(config: Any) -> bool:
    """One of the families above (their causal LM heads are known: a linear head, Gemma 2's final-logit cap)."""
    return getattr(config, "model_type", None) in BY_MODEL_TYPE


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """The sliding window of every decoder layer (None: global attention), as the family's attention reads it:
    `layer_types` where the config has them (Qwen2/3, Gemma 2/3), else `sliding_window` on every layer
    (Mistral, Phi-3)."""
    cfg = _as_dict(config)
    layers = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:  # Qwen2 configs written before `layer_types`
        window = None
    types = cfg.get("layer_types")
    if types:
        return tuple(window if t == "sliding_attention" and window else None for t in types)
    return (int(window) if window else None,) * layers
