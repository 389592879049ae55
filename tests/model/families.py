"""Tiny random checkpoints of every tested decoder family, built and saved by transformers itself, and the
oracle for them: transformers' own eager model on each packed document alone.

Each config exercises what its family adds to Llama: sliding windows shorter than the documents (Mistral on
every layer, Qwen2 and Gemma on some), Qwen3's QK-norm with head_dim ≠ hidden/heads, Gemma 2's attention and
final-logit soft-capping (caps small enough to change the loss), Gemma 3's local/global layers and scaled tied
embeddings, Phi-3's fused projections, Qwen3-MoE's routed experts (8, top-2, sharded by FSDP on the expert
dimension; the other mixtures and the router's auxiliary loss: tests/model/test_moe.py). Weights are drawn wider
than the families' defaults (initializer_range) so that attention scores reach the caps and the windows change the
result (and a token routed to the wrong experts changes the loss).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from shardline.data.prepare import PreparedData
from tests.oracle import IGNORE, documents_of_rows

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)
WINDOW = 16  # shorter than most text-to-SQL documents here (40-90 tokens)
CONFIGS = {
    "llama": (LlamaConfig, {}),
    "qwen2": (Qwen2Config, dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3": (Qwen3Config, dict(head_dim=32)),
    "mistral": (MistralConfig, dict(sliding_window=WINDOW)),
    "gemma2": (Gemma2Config, dict(head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=2.0,
                                  final_logit_softcapping=3.0, query_pre_attn_scalar=16)),
    "gemma3": (Gemma3TextConfig, dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                      layer_types=["sliding_attention", "full_attention"])),
    "phi3": (Phi3Config, {}),
    "qwen3_moe": (Qwen3MoeConfig, dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)),
}
FAMILIES = list(CONFIGS)
DENSE_FAMILIES = [name for name in FAMILIES if not name.endswith("_moe")]
"""What the planner sizes (it refuses a mixture of experts by name)."""


def write_family_checkpoint(name: str, tok: PreTrainedTokenizerBase, path: Path) -> Path:
    """`save_pretrained` of the family's tiny model (fp32 safetensors) with `tok` beside it."""
    cls, extra = CONFIGS[name]
    config = cls(**COMMON, **extra, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                 pad_token_id=tok.pad_token_id)
    torch.manual_seed(sum(map(ord, name)))
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def eager(path: Path, **overrides) -> torch.nn.Module:
    """transformers' own model of the checkpoint, eager attention (its masks, its soft-capping)."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                **overrides)


def one_document_at_a_time(model: torch.nn.Module, data: PreparedData, rows: list[int]) -> tuple[torch.Tensor, int]:
    """Summed next-token loss (with grad) over the documents of packed `rows`, each run alone, and the number
    of loss tokens: the loss shardline's packed rows must reproduce."""
    packed = data.rows("train")
    total, count = torch.zeros((), dtype=torch.float64), 0
    for r in rows:
        at = 0
        for doc in documents_of_rows(data, [r]):
            ids = torch.tensor([doc])
            keep = torch.tensor(packed.loss_mask[r, at: at + len(doc)], dtype=torch.bool)[None]
            logits = model(input_ids=ids).logits.float()
            labels = torch.where(keep, ids, IGNORE)[0, 1:]
            total = total + torch.nn.functional.cross_entropy(logits[0, :-1], labels, ignore_index=IGNORE,
                                                              reduction="sum").double()
            count += int((labels != IGNORE).sum())
            at += len(doc)
    return total, count
