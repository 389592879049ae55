"""LoRA on a mixture of experts' routers (`router` among `model.lora.target_modules`; off by default: the router
stays frozen unless asked).

The routers of the trained families (`Qwen3MoeTopKRouter` and its siblings) are not `nn.Linear`s but a `weight
[E, H]` the family's forward reads, so peft's `target_modules` cannot take them. Each router gets `lora_A [r, H]`
and `lora_B [E, r]` (peft's init: lora_A kaiming-uniform, lora_B zeros) and a forward hook that adds
`(alpha / r) · (x·Aᵀ)·Bᵀ` to the router logits and chooses the top-k from them as the family does
(`moe.choose_top_k`): the router of `W + (alpha / r)·B·A`. The hook runs before router biases' and the expert
counters' hooks (registered later), so they see the adapted choice. Export merges the adapters into `W`
(`--merge-lora`) or writes them as peft's `target_parameters` adapter on `mlp.gate.weight` (`peft_router_weights`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from shardline.model.moe import adapters_disabled, choose_top_k, routers


def add_router_adapters(lm: nn.Module, r: int, alpha: float) -> list[nn.Module]:
    """Give every router of the causal LM `lm` trainable adapters (on its weight's device and dtype: the meta device
    before `materialize` fills them) and the hook that applies them; returns the routers."""
    found = routers(lm)
    for router in found:
        experts, hidden = router.weight.shape
        like = dict(device=router.weight.device, dtype=router.weight.dtype)
        router.lora_A = nn.Parameter(torch.zeros(r, hidden, **like))
        router.lora_B = nn.Parameter(torch.zeros(experts, r, **like))
        router.lora_scaling, router.lora_disabled = alpha / r, False
        router.lora_hook = router.register_forward_hook(_adapted)
    return found


def _adapted(router: nn.Module, args: tuple, out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The router's output with its logits adapted: `(logits + s·(x·Aᵀ)·Bᵀ, weights, chosen)`."""
    if router.lora_disabled:
        return out
    logits, scores, _ = out
    x = args[0].reshape(-1, router.lora_A.shape[1])
    delta = nn.functional.linear(nn.functional.linear(x, router.lora_A), router.lora_B) * router.lora_scaling
    logits = logits + delta.to(logits.dtype)
    weights, chosen = choose_top_k(router, logits)
    return logits, weights.to(scores.dtype), chosen


def adapted_routers(lm: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, router) of each router of `lm` that carries adapters."""
    return [(name, m) for name, m in lm.named_modules() if isinstance(getattr(m, "lora_A", None), nn.Parameter)
            and hasattr(m, "lora_hook")]


@contextlib.contextmanager
def router_adapters_off(lm: nn.Module) -> Iterator[None]:
    """The routers route with their base weights alone inside (DPO's reference, as peft's `disable_adapter`)."""
    with adapters_disabled([m for _, m in adapted_routers(lm)]):
        yield


def merge_router_adapters(lm: nn.Module) -> None:
    """Fold each router's adapters into its weight (`W += s·B·A`) and drop them and the hook: transformers' router
    again. A plain model: whole tensors, no DTensor."""
    with torch.no_grad():
        for _, router in adapted_routers(lm):
            delta = (router.lora_B.float() @ router.lora_A.float()) * router.lora_scaling
            router.weight.add_(delta.to(router.weight.dtype))
            router.lora_hook.remove()
            del router.lora_A, router.lora_B, router.lora_scaling, router.lora_disabled, router.lora_hook


def router_target_parameters(lm: nn.Module) -> list[str]:
    """peft's `target_parameters` for the adapted routers of `lm`: their weight by its suffix (`mlp.gate.weight`)."""
    return sorted({".".join(name.split(".")[-2:]) + ".weight" for name, _ in adapted_routers(lm)})


def peft_router_weights(lm: nn.Module, peft_base: nn.Module) -> dict[str, torch.Tensor]:
    """The routers' adapters of the trained `lm` under the keys peft saves for them on `peft_base` (a peft model
    built with `router_target_parameters`: one `ParamWrapper` per router, `lora_A.weight (r, H)`, `lora_B.weight
    (E, r)` as here)."""
    from peft.tuners.lora.layer import ParamWrapper

    ours = dict(adapted_routers(lm))
    found = {}
    for path, wrapper in peft_base.named_modules():
        module_path = path.removeprefix("base_model.model.")
        if isinstance(wrapper, ParamWrapper) and module_path in ours:
            router = ours[module_path]
            found[f"{path}.lora_A.weight"], found[f"{path}.lora_B.weight"] = router.lora_A, router.lora_B
    return found
