"""What a mixture of experts adds to the memory plan (`planning.memory`): its MLP is a router and E routed experts
(and, in Qwen2-MoE, a shared expert behind a sigmoid gate) of which each token runs through k.

Symbols as in `planning.memory`, and E routed experts per layer, k experts per token, I the expert's intermediate
size, I_s a shared expert's, ep = parallel.ep, efsdp = dp_shard / ep.

- parameters: router E·d, experts 3·E·d·I (gate_up [E, 2I, d], down [E, d, I]), shared expert 3·d·I_s + its gate d.
  Every parameter is sharded over dp_shard ranks in all, the experts too: E/ep experts per EP rank, each sharded by
  FSDP over efsdp ranks (`shardline.parallel.expert`), so weights, gradients and AdamW state per rank are the dense
  formulas' with the experts in P; what EP changes is what a rank gathers: a block's non-expert weights whole, and
  only its own E/ep experts (`gathered_block`).
- activations, per token and MoE layer: the router's logits (c·E) and fp32 probabilities (4·E), its top-k indices
  and weights (12·k); the dispatch's int64 orders (24·k); per routed copy (k per token) the copy returned and the
  copy weighted (2·c·d: the weighting's and the sum's `index_add` keep them) and its weight (c), and on the rank
  that computes it the expert's output (c·d, kept by the `index_copy` back to arrival order), its input (c·d, with
  trained experts), gate_up's output (2·c·I), act(gate) (c·I) and the product that goes into down (c·I, with trained
  experts): as torch's memory tracker counts expert parallel's forward in the dry run. A compiled block is not
  planned differently (expert parallel refuses compile).
- all-to-all buffers (ep > 1): while a MoE layer runs backward, the routed copies' gradients in flight: the send and
  the receive buffer of one all-to-all at a time (2·c·k·d per token), beside the experts' intermediates' gradients
  (c·k·(d + 3·I)).
- imbalance: the dry run and this plan assume balanced routing (each EP rank receives k·N copies). A rank whose
  experts are chosen by f times its share receives f·k·N copies: its receive-side activations and buffers grow by
  that factor; `imbalance_headroom` is the largest f at which the plan still fits.
- capacity (`train.expert_capacity_factor` f): each expert takes at most C = ceil(N·k/E·f) copies of a rank's
  micro-batch of N tokens (`model.families.expert_capacity`), so an EP rank's E/ep experts receive at most E·C copies
  from the ep ranks of their group, E·C/(k·N) ≈ f times the balanced share (and at most its group's every copy, ep
  times): `capacity_share`. With a factor the plan sizes the receive side at that bound, whatever the routing, and
  needs no headroom; the send side stays every copy (a bound, not the kept copies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from shardline.errors import SpecError
from shardline.model.families import EXPERT_COUNT_FIELDS, expert_capacity


@dataclass(frozen=True)
class Experts:
    """The routed experts of every MoE layer (all layers are MoE layers)."""

    count: int
    top_k: int
    intermediate: int
    shared_intermediate: int = 0
    """A shared expert every token runs through, behind a sigmoid gate (Qwen2-MoE); 0: none."""

    def per_layer(self, hidden: int) -> int:
        """Routed-expert weights of one layer: gate_up [E, 2I, d] and down [E, d, I]."""
        return 3 * self.count * hidden * self.intermediate

    @property
    def active_fraction(self) -> float:
        return self.top_k / self.count


class ModelShape(Protocol):
    """What these terms read of `planning.memory.ModelShape` (which imports this module)."""

    hidden: int
    moe: Experts | None


def experts_of(cfg: dict, where: str = "model.path") -> Experts:
    """The experts of a mixture-of-experts config (a dict): the count under either field name the families use, the
    expert's intermediate size (`moe_intermediate_size`, else `intermediate_size`: Mixtral, OLMoE), a shared expert's.
    Configs that keep some layers dense (`mlp_only_layers`, `decoder_sparse_step` > 1) are refused by name."""
    count = next((int(cfg[f]) for f in EXPERT_COUNT_FIELDS if cfg.get(f)), 0)
    dense = list(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step") or 1)
    if dense or step > 1:
        raise SpecError(where, f"{cfg.get('model_type')} keeps dense MLPs in some layers (mlp_only_layers {dense}, "
                        f"decoder_sparse_step {step}), which the planner does not size",
                        "train it without a plan; `plan` sizes mixtures whose every layer is a MoE layer")
    return Experts(count, int(cfg["num_experts_per_tok"]),
                   int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                   int(cfg.get("shared_expert_intermediate_size") or 0))


def config_fields(e: Experts, config_defaults: object) -> dict:
    """The keywords that give a transformers config of the family (`config_defaults`: its default instance) these
    experts, by the field names that config has."""
    count_field = next(f for f in EXPERT_COUNT_FIELDS if hasattr(config_defaults, f))
    size_field = "moe_intermediate_size" if hasattr(config_defaults, "moe_intermediate_size") else "intermediate_size"
    fields = {count_field: e.count, size_field: e.intermediate, "num_experts_per_tok": e.top_k}
    if hasattr(config_defaults, "shared_expert_intermediate_size"):
        fields["shared_expert_intermediate_size"] = e.shared_intermediate
    return fields


def mlp_params(s: ModelShape) -> int:
    """A MoE layer's MLP: the router, the routed experts, a shared expert and its gate."""
    e, d = s.moe, s.hidden
    shared = 3 * d * e.shared_intermediate + d if e.shared_intermediate else 0
    return e.count * d + e.per_layer(d) + shared


def expert_params(s: ModelShape) -> int:
    """The routed experts' weights of one layer (0 for a dense model)."""
    return s.moe.per_layer(s.hidden) if s.moe else 0


def expert_adapter_params(s: ModelShape, r: int) -> int:
    """LoRA on one layer's routed experts (`experts` among `model.lora.target_modules`): per expert r·(in + out) on
    each fused projection, gate_up (d → 2I) and down (I → d)."""
    e, d = s.moe, s.hidden
    return e.count * r * ((d + 2 * e.intermediate) + (e.intermediate + d))


def gathered_block(s: ModelShape, block: int, ep: int) -> int:
    """What FSDP gathers of one block: everything but the experts other EP ranks hold."""
    return block - expert_params(s) * (ep - 1) // ep


def mlp_saved_bytes(s: ModelShape, c: int, trains_experts: bool, imbalance: float = 1.0) -> float:
    """Bytes a MoE layer's MLP saves for backward per token (eager), the rows this rank computes scaled by
    `imbalance` (its share of the routed copies against a balanced one)."""
    e, d = s.moe, s.hidden
    router = (c + 4) * e.count + 12 * e.top_k
    send = e.top_k * (24 + c * (2 * d + 1))
    receive = e.top_k * c * ((2 * d + 4 * e.intermediate) if trains_experts else d + 3 * e.intermediate)
    shared = c * (d + 4 * e.shared_intermediate + 2) if e.shared_intermediate else 0
    return router + send + imbalance * receive + shared


def mlp_selective_bytes(s: ModelShape, c: int, imbalance: float = 1.0) -> float:
    """Selective AC of a MoE layer's MLP per token: the matmul outputs (router logits, each routed copy's gate_up and
    down outputs, a shared expert's three)."""
    e, d = s.moe, s.hidden
    shared = c * (2 * e.shared_intermediate + d + 1) if e.shared_intermediate else 0
    return c * e.count + imbalance * c * e.top_k * (2 * e.intermediate + d) + shared


def mlp_backward_bytes(s: ModelShape, c: int, ep: int, imbalance: float = 1.0) -> float:
    """Gradients in flight while a MoE layer's MLP runs backward, per token: the experts' intermediates' and (with
    ep > 1) the all-to-all buffers (`all_to_all_bytes`)."""
    e = s.moe
    return imbalance * c * e.top_k * (s.hidden + 3 * e.intermediate) + all_to_all_bytes(s, c, ep, imbalance)


def all_to_all_bytes(s: ModelShape, c: int, ep: int, imbalance: float = 1.0) -> float:
    """Per token: the send and the receive buffer of the routed copies' gradients in one all-to-all (expert parallel
    only; with ep = 1 no token leaves its rank)."""
    if ep == 1 or not s.moe:
        return 0.0
    return (1 + imbalance) * c * s.moe.top_k * s.hidden


def capacity_share(s: ModelShape, tokens: int, ep: int, factor: float) -> float:
    """The most routed copies an EP rank computes per micro-batch of `tokens` tokens under capacity `factor`,
    against its balanced share (k·tokens): E·ceil(tokens·k/E·factor)/(k·tokens), at most ep (its group's every
    copy)."""
    e = s.moe
    return min(e.count * expert_capacity(tokens, e.top_k, e.count, factor) / (tokens * e.top_k), float(ep))


def expert_shards(s: ModelShape, ep: int, dp_shard: int) -> str:
    """How the experts are split, as `plan` says it."""
    e = s.moe
    efsdp = dp_shard // ep
    if ep == 1:
        return (f"experts: {e.count} per layer, top-{e.top_k}; no expert parallel: FSDP shards them over its "
                f"{dp_shard} rank{'s' if dp_shard != 1 else ''} like every other weight and gathers all of a layer's")
    return (f"experts: {e.count} per layer, top-{e.top_k}; {e.count // ep} per EP rank (ep {ep}), each sharded over "
            f"{efsdp} efsdp rank{'s' if efsdp != 1 else ''} (dp_shard {dp_shard} = efsdp {efsdp} × ep {ep})")
