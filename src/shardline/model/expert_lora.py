"""LoRA on a mixture of experts' routed experts (`model.lora.target_modules: [..., experts]`): low-rank adapters on
both fused projections of every MoE layer (`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`), the
router and the base weights frozen.

The adapters are kept per expert, expert dimension first like the weights they adapt: `lora_A.<proj> [E, r, in]`
and `lora_B.<proj> [E, out, r]` on the experts module, so that expert parallel shards them on dim 0 with their
weights (each rank holds its own experts' adapters) and FSDP on dim 1 over the rest. The forward adds
`(alpha / r) · (x·Aᵉᵀ)·Bᵉᵀ` per token of expert e (`shardline.model.moe.run_experts`), never a ΔW of every
expert. peft 0.21 reaches fused experts through `target_parameters`, but lays `lora_B` out as `(out, r·E)` with the
experts innermost (sharding it on dim 1 splits ranks, not experts), builds ΔW for every expert each forward and
refuses dropout; here dropout on the experts is a named error and peft's layout is written at export only
(`peft_layout`), where the adapter loads with peft's `PeftModel.from_pretrained`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from shardline.errors import SpecError
from shardline.model.moe import EXPERT_WEIGHTS, SortedExpertsForward, adapters_disabled, expert_modules


def check_expert_dropout(dropout: float) -> None:
    if dropout:
        raise SpecError("model.lora.dropout", f"is {dropout} with experts in model.lora.target_modules: dropout on "
                        "the adapter's input cannot be factored out of the fused experts' low-rank path (peft refuses "
                        "it on fused experts too)", "set model.lora.dropout=0, or leave experts out of "
                        "model.lora.target_modules")


def add_expert_adapters(model: nn.Module, r: int, alpha: float) -> list[nn.Module]:
    """Give every routed-experts module of `model` trainable adapters on both projections (on the weights' device
    and dtype: the meta device before `materialize`, which gives lora_A peft's uniform init and lora_B zeros) and the
    forward that applies them; returns the modules."""
    modules = expert_modules(model)
    for module in modules:
        a, b = nn.ParameterDict(), nn.ParameterDict()
        for name in EXPERT_WEIGHTS:
            weight = getattr(module, name)
            experts, out, inp = weight.shape
            a[name] = nn.Parameter(torch.zeros(experts, r, inp, device=weight.device, dtype=weight.dtype))
            b[name] = nn.Parameter(torch.zeros(experts, out, r, device=weight.device, dtype=weight.dtype))
        module.lora_A, module.lora_B, module.lora_scaling = a, b, alpha / r
        module.forward = SortedExpertsForward(module)  # expert parallel replaces it by its dispatch
    return modules


def has_expert_adapters(model: nn.Module) -> bool:
    return bool(_adapted(model))


@contextlib.contextmanager
def expert_adapters_off(model: nn.Module) -> Iterator[None]:
    """The experts compute with their base weights alone inside (as peft's `disable_adapter` does for its layers)."""
    with adapters_disabled([m for _, m in _adapted(model)]):
        yield


def merge_expert_adapters(model: nn.Module) -> None:
    """Fold each expert's adapters into its weights (`W += scaling · B·A`, per expert) and drop them: the module is
    transformers' own again (its forward, its parameters). A plain model: whole tensors, no DTensor."""
    with torch.no_grad():
        for _, module in _adapted(model):
            for name in EXPERT_WEIGHTS:
                weight = getattr(module, name)
                delta = torch.bmm(module.lora_B[name].float(), module.lora_A[name].float()) * module.lora_scaling
                weight.add_(delta.to(weight.dtype))
            del module.lora_A, module.lora_B, module.lora_scaling, module.forward


def peft_layout(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert adapters `A [E, r, in]`, `B [E, out, r]` as peft 0.21's `ParamWrapper` holds them: `lora_A.weight
    (r·E, in)` experts outermost, `lora_B.weight (out, r·E)` experts innermost (its `get_delta_weight` reads them as
    `(E, r, in)` and `(out, r, E)`)."""
    experts, out, r = b.shape
    return a.reshape(experts * r, a.shape[-1]).contiguous(), b.permute(1, 2, 0).reshape(out, r * experts).contiguous()


def peft_expert_weights(model: nn.Module, peft_base: nn.Module) -> dict[str, torch.Tensor]:
    """The experts' adapters of the trained `model` under the keys peft saves for them on `peft_base` (a peft model
    built with `target_parameters` of every routed experts module's projections: one nested `ParamWrapper` per
    projection, its key the wrapper's module path without peft's adapter name)."""
    from peft.tuners.lora.layer import ParamWrapper

    ours = dict(_adapted(model))
    found = {}
    for path, wrapper in peft_base.named_modules():
        if not isinstance(wrapper, ParamWrapper):
            continue
        module_path = path.removeprefix("base_model.model.")
        while module_path.endswith(".base_layer"):
            module_path = module_path.removesuffix(".base_layer")
        if module_path not in ours:  # a router's (`shardline.model.router_lora`)
            continue
        module = ours[module_path]
        a, b = peft_layout(module.lora_A[wrapper.parameter_name], module.lora_B[wrapper.parameter_name])
        found[f"{path}.lora_A.weight"], found[f"{path}.lora_B.weight"] = a, b
    return found


def expert_target_parameters(model: nn.Module) -> list[str]:
    """peft's `target_parameters` for the adapted experts of `model`: each projection by its suffix."""
    paths = sorted({".".join(name.split(".")[-2:]) for name, _ in _adapted(model)})  # mlp.experts
    return [f"{path}.{name}" for path in paths for name in EXPERT_WEIGHTS]


def _adapted(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of each routed-experts module of `model` that carries adapters."""
    return [(name, m) for name, m in model.named_modules()
            if name.endswith("mlp.experts") and isinstance(getattr(m, "lora_A", None), nn.ParameterDict)]
