"""One generation routine for the evaluation's greedy answers and GRPO's sampled rollouts: prompts of different
lengths left-padded into one batch (every prompt ends where generation starts) and one `generate` call with a
KV cache."""

from __future__ import annotations

import torch
from torch import nn


def generate_left_padded(model: nn.Module, prompts: list[list[int]], pad: int, device: torch.device,
                         **generate: object) -> list[list[int]]:
    """Each prompt's continuation (the ids `model.generate` produced after it, padding included) from one call
    over the prompts left-padded with `pad`; `generate` holds the call's own arguments (sampling, stops)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), pad_token_id=pad, use_cache=True,
                         **generate)
    return out[:, width:].cpu().tolist()
