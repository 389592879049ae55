"""How a mixture-of-experts checkpoint stores the fused expert weights transformers 5 holds.

The model holds each layer's routed experts as two 3-D parameters (`mlp.experts.gate_up_proj [E, 2I, H]`,
`mlp.experts.down_proj [E, H, I]`); hub checkpoints, and transformers' own `save_pretrained`, keep one tensor per
expert and projection (`mlp.experts.3.gate_proj.weight`; Mixtral's `block_sparse_moe.experts.3.w1.weight`). The
mapping between the two is transformers' own (`transformers.conversion_mapping` for the model, applied with
`core_model_loading.rename_source_key`): its renamings, then converters that stack experts on dim 0
(`MergeModulelist`) and concatenate the projections on dim 1 (`Concatenate`). A converter with any other operation
is refused by name. A checkpoint that already stores the fused names loads as it is.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from shardline.errors import SpecError

FUSED_SUFFIXES = (".experts.gate_up_proj", ".experts.down_proj")
"""How the model (and a fused checkpoint) names the routed experts' weights."""


@dataclass(frozen=True)
class StackedExperts:
    """A fused parameter read from per-expert tensors: `parts[j][e]` is the checkpoint key of projection j (in
    concatenation order) of expert e; the parameter is, over experts, the stack of the parts concatenated on their
    dim 0."""

    parts: tuple[tuple[str, ...], ...]

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(k for part in self.parts for k in part)


def stores_fused_experts(keys: Iterable[str]) -> bool:
    """Whether a checkpoint's keys hold the experts as fused tensors (not one per expert)."""
    return any(k.endswith(FUSED_SUFFIXES) for k in keys)


def model_keys(model: nn.Module, keys: Iterable[str]) -> dict[str, str | StackedExperts]:
    """Model parameter name → the checkpoint key that holds it, or the per-expert keys stacked into it, by
    transformers' conversion mapping of `model` (a causal LM)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        Concatenate,
        MergeModulelist,
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    keys = list(keys)
    if stores_fused_experts(keys):
        return {k: k for k in keys}
    transforms = get_model_conversion_mapping(model, add_legacy=False)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    for converter in converters:
        ops = [(type(op), getattr(op, "dim", None)) for op in converter.operations]
        if ops not in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)]):
            raise SpecError("model.path", f"{model.config.model_type}'s checkpoint conversion "
                            f"{converter.source_patterns} -> {converter.target_patterns} uses operations "
                            f"{[t.__name__ for t, _ in ops]} that shardline does not read",
                            "use a checkpoint that stores the fused expert weights (save_pretrained(..., "
                            "save_original_format=False))")
    order = {pattern: (c, j) for c in converters for j, pattern in enumerate(c.source_patterns)}
    direct: dict[str, str | StackedExperts] = {}
    stacked: dict[str, dict[int, dict[int, str]]] = defaultdict(lambda: defaultdict(dict))
    for key in keys:
        name, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            direct[name] = key
            continue
        _, part = order[pattern]
        expert = [int(x) for x in key.split(".") if x.isdigit()][-1]  # the `*` the pattern matched
        stacked[name][part][expert] = key
    for name, parts in stacked.items():
        experts = [sorted(p) for p in parts.values()]
        if any(e != list(range(len(experts[0]))) for e in experts):
            raise SpecError("model.path", f"the checkpoint's experts of {name} are incomplete: "
                            f"{[len(e) for e in experts]} experts per projection",
                            "use a complete checkpoint (every expert of every layer)")
        direct[name] = StackedExperts(tuple(tuple(parts[j][e] for e in sorted(parts[j])) for j in sorted(parts)))
    return direct
