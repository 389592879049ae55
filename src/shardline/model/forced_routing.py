"""Balanced routing forced for throughput benchmarks: `SHARDLINE_BALANCED_ROUTING=1` in a worker's environment
(bench/moe_a3b.py's balanced mode; a benchmark switch, never a training setting) makes every router of a mixture of
experts send token t's j-th routed copy to expert (t·k + j) mod E, so each expert receives N·k/E of a micro-batch's
N·k copies (exactly, when E divides N·k) — NeMo AutoModel's `fake_balanced_gate` and Megatron-Core's
`--moe-router-force-load-balancing`, which their published MoE numbers use. The dry run assumes the same split
(`planning.simulation.balanced_routing`). The router itself still runs (its logits, softmax and gradient): a copy's
weight is the router's probability of the forced expert, normalised over the k as the family does.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from shardline.model.moe import routers

BALANCED_ROUTING_ENV = "SHARDLINE_BALANCED_ROUTING"


def balanced_top_k(tokens: int, k: int, experts: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[tokens, k] expert indices: token t's j-th choice is (t·k + j) mod `experts` (k distinct experts per token
    when k ≤ experts)."""
    return (torch.arange(tokens * k, device=device) % experts).view(tokens, k)


def balanced_routing_forced() -> bool:
    """Whether this process's environment forces balanced routing (`SHARDLINE_BALANCED_ROUTING=1`)."""
    return os.environ.get(BALANCED_ROUTING_ENV) == "1"


def force_balanced_routing(lm: nn.Module) -> None:
    """Every router of `lm` chooses `balanced_top_k` (forward hooks on the family's routers, whose output is
    `(logits [N, E], scores [N, k], indices [N, k])`); a dense model is left as it is."""
    for router in routers(lm):
        router.register_forward_hook(_balanced)


def _balanced(router: nn.Module, _args, out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    logits, scores, _ = out
    probabilities = torch.nn.functional.softmax(logits, dim=-1, dtype=torch.float)
    chosen = balanced_top_k(logits.shape[0], router.top_k, logits.shape[-1], logits.device)
    weights = probabilities.gather(-1, chosen)
    if getattr(router, "norm_topk_prob", True):  # Mixtral's router always normalises (it has no flag)
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(scores.dtype), chosen
