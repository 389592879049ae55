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

Capacity (`train.expert_capacity_factor`, off by default): each expert takes at most
ceil(tokens·k / E · factor) routed copies per forward (one micro-batch of one rank), Megatron-Core's `get_capacity`
of its `tokens · topk` copies (GShard's and Switch's capacity with k copies a token); the copies over it are dropped
lowest routing weight first (Megatron-Core's drop policy "probs"; equal weights: the later position first), before
any dispatch, and counted (`ExpertLoad`, the step's `expert_dropped`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardline.data.spans import DocumentSpans
from shardline.errors import SpecError
from shardline.model.families import EXPERT_COUNT_FIELDS, expert_capacity


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
    """The routed experts' fused weights and their LoRA adapters where they carry them (parameters of each
    `….mlp.experts` module: a token runs through k of E of both); a shared expert, the router and dense layers are
    not among them."""
    return [p for module in expert_modules(model) for p in module.parameters()]


def aux_loss_coefficient(config: Any) -> float:
    """The router auxiliary loss's weight in the training loss: the config's `router_aux_loss_coef` when its
    `output_router_logits` is true, else 0 (off: the default of hub configs)."""
    if not is_moe(config) or not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


Z_LOSS_FIELD = "router_z_loss_coef"
"""Where the model's config carries `train.router_z_loss_coef` for the loss (`set_z_loss_coefficient`)."""


def set_z_loss_coefficient(config: Any, coefficient: float) -> None:
    """Put `train.router_z_loss_coef` on the model's config (transformers' name for it), where the loss reads it;
    a SpecError for a coefficient above 0 on a dense model."""
    if coefficient and not is_moe(config):
        model = getattr(config, "model_type", "the model")
        raise SpecError("train.router_z_loss_coef", f"is {coefficient}, but {model} has no router (not a mixture of "
                        "experts)", "set train.router_z_loss_coef=0")
    setattr(config, Z_LOSS_FIELD, float(coefficient))


def z_loss_coefficient(config: Any) -> float:
    """The router z-loss's weight in the training loss: `train.router_z_loss_coef` (0: off)."""
    return float(getattr(config, Z_LOSS_FIELD, 0.0) or 0.0) if is_moe(config) else 0.0


def forward_kwargs(config: Any) -> dict[str, Any]:
    """Keywords for shardline's own forwards: an MoE model computes no aux loss of its own there (it would apply
    shardline's placeholder attention mask to the tokens); `aux_loss_term` does instead."""
    return {"output_router_logits": False} if is_moe(config) else {}


def routers(lm: nn.Module) -> list[nn.Module]:
    """Each MoE layer's router (the family's class transformers records `router_logits` from), in layer order; none
    for a dense model. In the four families it returns `(logits [N, E], scores [N, k], indices [N, k])`."""
    if not is_moe(lm.config):
        return []
    recorder = type(lm)._can_record_outputs["router_logits"]
    return [m for m in lm.modules() if isinstance(m, recorder.target_class)]


@contextlib.contextmanager
def adapters_disabled(modules: list[nn.Module]) -> Iterator[None]:
    """Inside, each of `modules` (the experts' or the routers' adapted modules) computes with its base weights alone:
    their `lora_disabled` flag, which their forwards read (as peft's `disable_adapter` does for its layers)."""
    for module in modules:
        module.lora_disabled = True
    try:
        yield
    finally:
        for module in modules:
            module.lora_disabled = False


def choose_top_k(router: nn.Module, logits: torch.Tensor,
                 bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, chosen) of a router of the four families from its `logits`: the top-k of softmax(logits) (+ `bias`
    for the choice only, `model.router_bias`), weighted by their plain probabilities, normalised over the k as the
    family does (its `norm_topk_prob`; Mixtral's router, which has no flag, always)."""
    probabilities = torch.nn.functional.softmax(logits, dim=-1, dtype=torch.float)
    scored = probabilities if bias is None else probabilities + bias
    chosen = torch.topk(scored, router.top_k, dim=-1).indices
    weights = probabilities.gather(-1, chosen)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


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


def z_loss_term(lm: nn.Module, logits: list[torch.Tensor], spans: DocumentSpans | None, shape: torch.Size,
                loss_tokens: int) -> torch.Tensor:
    """What one micro-batch adds to the summed training loss for the router z-loss: coef · z · the loss-bearing tokens
    of the micro-batch on all ranks, z the mean over the real tokens of all ranks and every MoE layer of
    logsumexp(router logits)² (the row and loss-token totals all-reduced, this rank's squares its own: the shares of
    the ranks sum to the z-loss of all their tokens, as for `aux_loss_term`)."""
    flat = real_tokens(spans, shape).reshape(-1).to(device=logits[0].device, dtype=torch.float32)
    squares = sum((torch.logsumexp(layer.float(), dim=-1) ** 2 * flat).sum() for layer in logits)
    totals = torch.stack([flat.sum() * len(logits), torch.tensor(float(loss_tokens), device=flat.device)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)  # no host read: the totals stay on the device
    return squares / totals[0] * (z_loss_coefficient(lm.config) * totals[1])


class ExpertLoad:
    """Tokens routed to each expert of each MoE layer by the training forwards since the last `take` (forward hooks
    on the family's router; its top-k choice, biased where `shardline.model.router_bias` steers it): counted on the
    device, no host read, so that the step can carry them in its one all-reduce and host copy. Every position a
    router sees counts (a packed row's padding tail too: the experts compute it); forwards without gradients
    (validation, generation) and the recomputation of activation checkpointing in backward do not. A dense model has
    no routers: nothing is counted and `fields` is empty. With a capacity factor (`limit_expert_capacity`) the
    copies the experts dropped are counted too (by the experts' forwards, `count_dropped`), in one more slot."""

    def __init__(self, lm: nn.Module) -> None:
        config = lm.config
        self.experts = num_experts(config)
        found = routers(lm)
        self.counts: torch.Tensor | None = None
        self.layers = len(found)
        self.capped = [m for m in expert_modules(lm) if getattr(m, "capacity_factor", None)] if self.experts else []
        for i, router in enumerate(found):
            router.register_forward_hook(self._hook(i))

    def _hook(self, layer: int):
        def count(_module, _args, out) -> None:
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:  # no grad, or a recompute
                return
            chosen = out[-1].detach().reshape(-1)  # the router's top-k choice (`routers`)
            if self.counts is None:
                self.counts = torch.zeros(self.layers, self.experts, dtype=torch.float64, device=chosen.device)
            # scatter_add, not bincount: bincount reads its maximum on the host (a sync on a GPU)
            self.counts[layer].scatter_add_(0, chosen, torch.ones_like(chosen, dtype=torch.float64))

        return count

    def take(self) -> torch.Tensor:
        """The counts since the last call, flattened [layers × E] (empty for a dense model), then the copies dropped
        over capacity where a capacity factor is set, and start again."""
        counts, self.counts = self.counts, None
        flat = counts.reshape(-1) if counts is not None else torch.zeros(self.layers * self.experts,
                                                                          dtype=torch.float64)
        if not self.capped:
            return flat
        dropped = [m.dropped_copies.to(flat) for m in self.capped if m.dropped_copies is not None]
        for module in self.capped:
            module.dropped_copies = None
        return torch.cat([flat, sum(dropped, torch.zeros(1, dtype=flat.dtype, device=flat.device))])

    def fields(self, load: list[float]) -> dict[str, Any]:
        """The step record's load fields from the counts of all ranks (`take`, summed): tokens per expert over the
        layers, and the imbalance: the largest over layers of (busiest expert's tokens / the mean expert's)."""
        if not self.layers or not load:
            return {}
        dropped = {"expert_dropped": int(load[-1])} if self.capped else {}
        per_layer = torch.tensor(load[:self.layers * self.experts]).view(self.layers, self.experts)
        mean = per_layer.mean(dim=1).clamp(min=1e-9)
        return {"expert_tokens": [int(x) for x in per_layer.sum(dim=0).tolist()],
                "expert_imbalance": float((per_layer.max(dim=1).values / mean).max()), **dropped}


CAPACITY_FIELD = "train.expert_capacity_factor"


def limit_expert_capacity(model: nn.Module, factor: float | None) -> None:
    """Give every routed-experts module of `model` the capacity `factor` (`within_capacity`), run by shardline's
    forward (`SortedExpertsForward`, or expert parallel's dispatch, which read `module.capacity_factor`); None leaves
    the model as it is. A SpecError for a factor on a dense model."""
    if factor is None:
        return
    if not is_moe(model.config):
        name = getattr(model.config, "model_type", "the model")
        raise SpecError(CAPACITY_FIELD, f"is {factor}, but {name} has no routed experts (not a mixture of experts)",
                        f"remove {CAPACITY_FIELD} (or set it to null)")
    for module in expert_modules(model):
        module.capacity_factor, module.dropped_copies = float(factor), None
        if "forward" not in vars(module):  # transformers' own forward drops nothing; LoRA's is ours already
            module.forward = SortedExpertsForward(module)


def within_capacity(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, experts: int,
                    factor: float | None) -> torch.Tensor:
    """The expert of each routed copy (`top_k_index` flattened: token-major, top-k inner) with `experts`, one past
    the last, for a copy dropped over its expert's capacity (`expert_capacity` of these tokens): each expert keeps
    its copies of the largest routing weight, the earlier position where weights are equal. On the device, no host
    read; without a factor the copies as they are."""
    flat = top_k_index.reshape(-1)
    if factor is None:
        return flat
    capacity = expert_capacity(top_k_index.shape[0], top_k_index.shape[-1], experts, factor)
    heaviest = torch.argsort(top_k_weights.detach().reshape(-1), descending=True, stable=True)
    order = heaviest[torch.argsort(flat[heaviest], stable=True)]  # by expert, heaviest first
    counts = torch.zeros(experts, dtype=flat.dtype, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=flat.device) - (counts.cumsum(0) - counts)[flat[order]]
    return torch.where(rank < capacity, flat, experts)


def count_dropped(module: nn.Module, dropped: int) -> None:
    """Add a training forward's dropped copies to the module's count (`ExpertLoad.take` collects it); as for the
    expert load, forwards without gradients and activation checkpointing's recomputation do not count."""
    if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
        return
    device = module.gate_up_proj.device
    if module.dropped_copies is None:
        module.dropped_copies = torch.zeros(1, dtype=torch.float64, device=device)
    module.dropped_copies += dropped  # a host integer into a device tensor: no host read, no blocking copy


EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
"""The fused weights of a routed-experts module, expert dimension first."""


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _local(weight: torch.Tensor, gradient_scale: float) -> torch.Tensor:
    local = weight.to_local() if hasattr(weight, "to_local") else weight  # an expert-parallel DTensor: my experts
    return _ScaleGradient.apply(local, gradient_scale) if gradient_scale != 1.0 else local


class _ContiguousGradient(torch.autograd.Function):
    """Identity forward; backward hands the gradient on contiguous (torch's grouped matmul backward refuses an
    expanded one, e.g. the gradient of a `.sum()`)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_matmul_runs(rows: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """Whether torch's grouped matmul (`F.grouped_mm`) takes these operands: on CPU, or on CUDA in bf16 from SM 8.0,
    with every row of every operand a multiple of 16 bytes (`[E, out, in]` weights: in and out)."""
    if rows.device.type == "cuda":
        runs = rows.dtype == torch.bfloat16 and torch.cuda.get_device_capability(rows.device) >= (8, 0)
    else:
        runs = rows.device.type == "cpu"
    return runs and all(w.dtype == rows.dtype and all(d * w.element_size() % 16 == 0 for d in w.shape[-2:])
                        for w in weights)


def _expert_linear(x: torch.Tensor, weight: torch.Tensor, per_expert: list[int],
                   offsets: torch.Tensor | None) -> torch.Tensor:
    """Row block e of `x` (`per_expert[e]` rows) times `weight[e]ᵀ` for every expert: one grouped matmul where
    `offsets` (the blocks' ends, on the device) are given, else one matmul per expert."""
    if offsets is not None:
        return _ContiguousGradient.apply(nn.functional.grouped_mm(x, weight.transpose(-2, -1), offs=offsets))
    return torch.cat([nn.functional.linear(part, weight[e]) for e, part in enumerate(torch.split(x, per_expert))])


def run_experts(module: nn.Module, rows: torch.Tensor, per_expert: list[int], counts: torch.Tensor,
                gradient_scale: float = 1.0) -> torch.Tensor:
    """Each of the module's (local) experts on its consecutive rows of `rows` (`per_expert[e]` of them on the host,
    `counts` the same on the device): transformers' expert math `act(x·gate) * (x·up) · down`, plus, where the module
    carries LoRA adapters (`shardline.model.expert_lora`), `scaling · (x·Aᵉᵀ)·Bᵉᵀ` on each projection — the
    low-rank path per token, never a ΔW of every expert. Each projection is one grouped matmul over the experts
    where torch's runs (`grouped_matmul_runs`; equal to the loop over experts in fp32), else a loop. The weights'
    gradients are multiplied by `gradient_scale` (expert parallel's 1/ep)."""
    weights = {n: _local(getattr(module, n), gradient_scale) for n in EXPERT_WEIGHTS}
    factors = {}
    if getattr(module, "lora_A", None) is not None and not getattr(module, "lora_disabled", False):
        factors = {n: (_local(module.lora_A[n], gradient_scale), _local(module.lora_B[n], gradient_scale))
                   for n in EXPERT_WEIGHTS}
    operands = [*weights.values(), *(t for pair in factors.values() for t in pair)]
    offsets = counts.cumsum(0).to(torch.int32) if grouped_matmul_runs(rows, operands) else None

    def project(x: torch.Tensor, name: str) -> torch.Tensor:
        y = _expert_linear(x, weights[name], per_expert, offsets)
        if factors:
            a, b = factors[name]
            low_rank = _expert_linear(_expert_linear(x, a, per_expert, offsets), b, per_expert, offsets)
            y = y + low_rank * module.lora_scaling
        return y

    gate, up = project(rows, "gate_up_proj").chunk(2, dim=-1)
    return project(module.act_fn(gate) * up, "down_proj")


class SortedExpertsForward:
    """A routed-experts module's forward on the experts it holds whole (no expert parallel), by `run_experts`: the
    token copies sorted by expert (those over a capacity left out: `within_capacity`), each expert run on its rows
    (one host read of the counts), the outputs weighted and summed per token. Same signature and result as
    transformers' `(hidden_states [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H]`; used where the
    experts carry LoRA adapters transformers' forward ignores, or a capacity factor it knows nothing of."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        k, experts = top_k_index.shape[-1], self.module.gate_up_proj.shape[0]
        factor = getattr(self.module, "capacity_factor", None)
        routed = within_capacity(top_k_index, top_k_weights, experts, factor)
        counts = torch.bincount(routed, minlength=experts + 1)  # the last: copies dropped over capacity
        host = counts.tolist()  # the one host read
        order = torch.argsort(routed, stable=True)[:len(routed) - host[experts]]  # the dropped sort last
        if factor is not None:
            count_dropped(self.module, host[experts])
        token = order // k
        computed = run_experts(self.module, hidden_states[token], host[:experts], counts[:experts])
        weighted = computed * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add(0, token, weighted.to(hidden_states.dtype))
