"""Auxiliary-loss-free load balancing (`train.router_bias_update_rate`): DeepSeek-V3's per-expert bias (Wang et al.,
"Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts", arXiv 2408.15664), as torchtitan keeps it
(`expert_bias`, updated by an optimizer pre-step hook from the step's all-reduced tokens per expert).

Each MoE layer's router gets a bias b [E], added to its scores (the softmax probabilities) for the top-k choice only:
a token goes to the k experts of largest `p + b`, and is weighted by its plain `p` (normalised over the k as the
family does), so the bias steers which experts a token uses but never how much they count, adds no loss term and no
gradient. After each step, from the step's tokens per expert c [E] summed over its forwards and all ranks (the counts
`ExpertLoad` carries in the step's one all-reduce), every layer's bias moves by `rate · sign(mean(c) − c)`, centred
(torchtitan's zero-mean delta: only relative biases change a top-k): an overloaded expert's bias falls, an idle one's
rises. Every rank updates its copy from the same all-reduced counts, so the biases stay equal on every rank and at
every `parallel.ep`; they are part of the checkpoint (an exact resume, at any world or EP size).
"""

from __future__ import annotations

import torch
from torch import nn

from shardline.errors import SpecError
from shardline.model.moe import choose_top_k, is_moe, num_experts, routers

RATE_FIELD = "train.router_bias_update_rate"


class RouterBias:
    """The per-expert biases [layers, E] of `lm`'s routers (zero at the start) and the forward hooks that choose the
    top-k by them: each router's output `(logits, scores, indices)` becomes `(logits, p[chosen] normalised as the
    family does, chosen)` with chosen = top-k of `softmax(logits) + bias`. Built after the weights are in place (its
    device is the routers'); a rate of 0 is no `RouterBias` at all (`router_bias`)."""

    def __init__(self, lm: nn.Module, rate: float) -> None:
        found = routers(lm)
        self.rate = rate
        self.bias = torch.zeros(len(found), num_experts(lm.config), dtype=torch.float32,
                                device=found[0].weight.device)
        for layer, router in enumerate(found):
            # before `ExpertLoad`'s hooks (built after this): they count the biased choice
            router.register_forward_hook(self._choose(layer))

    def _choose(self, layer: int):
        def choose(router: nn.Module, _args, out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            logits, scores, _ = out
            weights, chosen = choose_top_k(router, logits, self.bias[layer])
            return logits, weights.to(scores.dtype), chosen

        return choose

    @torch.no_grad()
    def update(self, load: torch.Tensor) -> None:
        """Move every layer's bias by the step's tokens per expert `load` ([layers × E] flattened, summed over the
        step's forwards and all ranks; on the device, no host read)."""
        counts = load.reshape(self.bias.shape).to(self.bias)
        delta = self.rate * torch.sign(counts.mean(dim=1, keepdim=True) - counts)
        self.bias += delta - delta.mean(dim=1, keepdim=True)


def check_router_bias(config: object, rate: float) -> None:
    """A SpecError for a rate above 0 on a dense model."""
    if rate and not is_moe(config):
        name = getattr(config, "model_type", "the model")
        raise SpecError(RATE_FIELD, f"is {rate}, but {name} has no router (not a mixture of experts)",
                        f"set {RATE_FIELD}=0")


def router_bias(lm: nn.Module, rate: float) -> RouterBias | None:
    """`lm`'s router biases updated at `rate` (`train.router_bias_update_rate`); None at 0 (off: the routers are
    transformers' own). A SpecError for a rate above 0 on a dense model."""
    check_router_bias(lm.config, rate)
    return RouterBias(lm, rate) if rate else None
