"""Mixture-of-experts models as transformers 5 builds them: which parameters are routed experts, how many of them a
token uses, and the family's router auxiliary (load-balancing) loss.

The model math is transformers' own (`Qwen3MoeSparseMoeBlock` and its siblings: top-k routing, experts held fused
as `mlp.experts.gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`, run by transformers' experts implementation);
FSDP2 shards those fused parameters on dim 0, the expert dimension, like any other parameter; expert parallelism
(`parallel.ep`: tokens sent to the ranks that hold their experts) is `shardline.parallel.expert`.

Auxiliary loss: on when the checkpoint's config says `output_router_logits: true` (hub configs ship false), with
the config's `router_aux_loss_coef`. `aux_loss_term` computes it as the family's own `load_balancing_loss_func`
does, over the router logits of every MoE layer of one micro-batch, real tokens only (a packed row's padding tail
is left out), with the expert counts and row totals all-reduced over the ranks (the same aux at every world size),
and weights it by the micro-batch's loss-bearing tokens on all ranks, so that the step's loss (summed, divided by
the step's loss tokens) is `cross-entropy + coef · aux` exactly as transformers computes it on one batch, and the
token-weighted mean of the micro-batches' aux terms over several.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from shardline.model.families import EXPERT_COUNT_FIELDS


class DocumentSpans(Protocol):
    """The documents of a batch (`shardline.data.spans.DocumentSpans`, which imports model.flops, so only its
    shape here): span lengths over the flattened rows and which spans are real (not a row's padding tail)."""

    lengths: tuple[int, ...]
    real: tuple[bool, ...]




def num_experts(config: Any) -> int:
    """Routed experts per MoE layer; 0 for a dense config."""
    return next((int(v) for f in EXPERT_COUNT_FIELDS if (v := getattr(config, f, None))), 0)


def is_moe(config: Any) -> bool:
    return num_experts(config) > 0


def active_expert_fraction(config: Any) -> float:
    """The share of routed-expert weights one token runs through: top-k of E (1 for a dense config)."""
    experts = num_experts(config)
    return config.num_experts_per_tok / experts if experts else 1.0


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """Each MoE layer's routed-experts module (`….mlp.experts`, holding the fused weights), in layer order."""
    return [module for name, module in model.named_modules() if name.endswith("mlp.experts")]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The routed experts' fused weights (parameters of each `….mlp.experts` module); a shared expert, the router
    and dense layers are not among them."""
    return [p for module in expert_modules(model) for p in module.parameters(recurse=False)]


def aux_loss_coefficient(config: Any) -> float:
    """The router auxiliary loss's weight in the training loss: the config's `router_aux_loss_coef` when its
    `output_router_logits` is true, else 0 (off: the default of hub configs)."""
    if not is_moe(config) or not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def forward_kwargs(config: Any) -> dict[str, Any]:
    """Keywords for shardline's own forwards: an MoE model computes no aux loss of its own there (it would apply
    shardline's placeholder attention mask to the tokens); `aux_loss_term` does instead."""
    return {"output_router_logits": False} if is_moe(config) else {}


@contextlib.contextmanager
def router_logits(lm: nn.Module, record: bool) -> Iterator[list[torch.Tensor]]:
    """The router logits ([tokens, E], one per MoE layer in order) of the forwards run inside, when `record`:
    forward hooks on the family's router class (the one transformers records `router_logits` from)."""
    found: list[torch.Tensor] = []
    if not record:
        yield found
        return
    recorder = type(lm)._can_record_outputs["router_logits"]
    hooks = [m.register_forward_hook(lambda _m, _a, out: found.append(out[recorder.index]))
             for m in lm.modules() if isinstance(m, recorder.target_class)]
    try:
        yield found
    finally:
        for hook in hooks:
            hook.remove()


def real_tokens(spans: DocumentSpans | None, shape: torch.Size) -> torch.Tensor:
    """[B, T] float mask of the tokens that are not a row's padding tail (all of them without spans)."""
    if spans is None:
        return torch.ones(shape)
    real = torch.tensor(spans.real, dtype=torch.float32)
    return real.repeat_interleave(torch.tensor(spans.lengths)).view(shape)


def router_statistics(config: Any, logits: list[torch.Tensor], mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The sums the family's Switch-style auxiliary loss is made of (transformers' `load_balancing_loss_func`, the
    same in all four families), over every MoE layer's router logits and the tokens `mask` ([B, T]) keeps: top-k
    assignments per expert [E], router probabilities per expert [E] (differentiable), and the rows counted."""
    experts, k = num_experts(config), config.num_experts_per_tok
    flat = mask.reshape(-1).to(device=logits[0].device, dtype=torch.float32)
    assigned = torch.zeros(experts, device=flat.device)
    probabilities = torch.zeros(experts, device=flat.device)
    for layer in logits:
        weights = torch.nn.functional.softmax(layer, dim=-1)
        _, selected = torch.topk(weights, k, dim=-1)
        assigned = assigned + torch.zeros_like(assigned).scatter_add_(0, selected.reshape(-1),
                                                                      flat.repeat_interleave(k))
        probabilities = probabilities + (weights.float() * flat.unsqueeze(-1)).sum(dim=0)
    return assigned, probabilities, flat.sum() * len(logits)


def aux_loss_term(lm: nn.Module, logits: list[torch.Tensor], spans: DocumentSpans | None, shape: torch.Size,
                  loss_tokens: int) -> torch.Tensor:
    """What one micro-batch adds to the summed training loss: this rank's share of coef · aux · the loss-bearing
    tokens of the micro-batch on all ranks, aux computed from the expert counts and row total all-reduced over the
    ranks (so the shares of the ranks sum to the aux of all their tokens, the same loss at every world size; the
    router probabilities stay this rank's own, the part its gradient flows through)."""
    config = lm.config
    assigned, probabilities, rows = router_statistics(config, logits, real_tokens(spans, shape))
    totals = torch.cat([assigned, rows.reshape(1), torch.tensor([float(loss_tokens)], device=rows.device)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)  # no host read: the totals stay on the device
    experts = num_experts(config)
    aux = torch.sum((totals[:experts] / totals[experts]) * (probabilities / totals[experts])) * experts
    return aux * (aux_loss_coefficient(config) * totals[experts + 1])


class ExpertLoad:
    """Tokens routed to each expert of each MoE layer by the training forwards since the last `take` (forward hooks
    on the family's router; the top-k of its logits, as the router selects): counted on the device, no host read, so
    that the step can carry them in its one all-reduce and host copy. Every position a router sees counts (a packed
    row's padding tail too: the experts compute it); forwards without gradients (validation, generation) and the
    recomputation of activation checkpointing in backward do not. A dense model has no routers: nothing is
    counted and `fields` is empty."""

    def __init__(self, lm: nn.Module) -> None:
        config = lm.config
        self.experts = num_experts(config)
        recorder = type(lm)._can_record_outputs["router_logits"] if self.experts else None
        routers = [m for m in lm.modules() if isinstance(m, recorder.target_class)] if recorder else []
        self.top_k = getattr(config, "num_experts_per_tok", 1)
        self.counts: torch.Tensor | None = None
        self.layers = len(routers)
        for i, router in enumerate(routers):
            router.register_forward_hook(self._hook(i, recorder.index))

    def _hook(self, layer: int, index: int):
        def count(_module, _args, out) -> None:
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:  # no grad, or a recompute
                return
            logits = out[index]
            if self.counts is None:
                self.counts = torch.zeros(self.layers, self.experts, dtype=torch.float64, device=logits.device)
            chosen = torch.topk(logits.detach(), self.top_k, dim=-1).indices.reshape(-1)
            # scatter_add, not bincount: bincount reads its maximum on the host (a sync on a GPU)
            self.counts[layer].scatter_add_(0, chosen, torch.ones_like(chosen, dtype=torch.float64))

        return count

    def take(self) -> torch.Tensor:
        """The counts since the last call, flattened [layers × E] (empty for a dense model), and start again."""
        counts, self.counts = self.counts, None
        return counts.reshape(-1) if counts is not None else torch.zeros(self.layers * self.experts)

    def fields(self, load: list[float]) -> dict[str, Any]:
        """The step record's load fields from the counts of all ranks (`take`, summed): tokens per expert over the
        layers, and the imbalance: the largest over layers of (busiest expert's tokens / the mean expert's)."""
        if not self.layers or not load:
            return {}
        per_layer = torch.tensor(load).view(self.layers, self.experts)
        mean = per_layer.mean(dim=1).clamp(min=1e-9)
        return {"expert_tokens": [int(x) for x in per_layer.sum(dim=0).tolist()],
                "expert_imbalance": float((per_layer.max(dim=1).values / mean).max())}
