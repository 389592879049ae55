"""`train.float8`: FP8 full fine-tuning with torchao's float8 training, on the decoder blocks' linear layers only.

Each block's `nn.Linear` whose both dimensions are multiples of 16 (what `torch._scaled_mm` takes) becomes torchao's
`Float8Linear`: input, weight and output gradient are cast to float8 (e4m3; rowwise: e4m3 for the gradient too,
tensorwise: e5m2) with dynamic scales — one per tensor (tensorwise) or one per row (rowwise) — and multiplied in
float8, accumulating in higher precision; the weights stay fp32 masters under FSDP2 and bf16 in compute. Left in
bf16: embeddings, the output projection, norms, a mixture's router (`gate`/`router`: routing decisions are
sensitive to rounding, and torchtitan keeps it high-precision too) and its routed experts (fused 3-D weights, not
`nn.Linear`). Conversion happens on the meta model, before FSDP2 wraps the blocks (torchtitan's order).

FSDP2's float8 all-gather (tensorwise only: a rowwise scale depends on the whole row, which a shard does not hold)
sends each block's weights as float8 — half of bf16's bytes — where the collective moves float8 tensors: on NCCL.
gloo has no float8 all-gather, so on CPU the weights are gathered in bf16 and cast after; the numbers are the same
(one dynamic scale of the whole weight either way). On CPU torch emulates float8 matmul: it runs (the CI tests
check numerics and composition) but is slower than bf16 — a CPU has no float8 units.

A checkpoint holds the fp32 masters under their usual names (`Float8Linear` keeps `weight` and `bias`), so DCP
save/resume and `shardline export` are unchanged: the exported weights are plain bf16/fp32 tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from shardline.errors import SpecError
from shardline.hardware import FLOAT8_DIM_MULTIPLE
from shardline.model.build import decoder_layers
from shardline.spec import Float8Recipe

FP8_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first GPUs with FP8 tensor cores (Ada: L4, L40S; Hopper 9.0; Blackwell 10.0)."""
HIGH_PRECISION_NAMES = ("gate", "router")
"""A block's linear layers left in bf16 by their attribute name: a mixture's router (`mlp.gate` in Mixtral, Qwen-MoE;
dense MLPs name theirs `gate_proj`, which is converted)."""


def check_float8_device(recipe: Float8Recipe, precision: str, device_type: str) -> None:
    """Refuse float8 training without bf16 around it (`train.precision` chose fp32) or on a CUDA GPU without FP8
    tensor cores (compute capability below 8.9)."""
    if recipe == "none":
        return
    if precision != "bf16":
        raise SpecError("train.float8", f"is {recipe}, but this run's precision is {precision}: float8 training "
                        "multiplies the block linears in float8 and keeps everything else in bf16",
                        "set train.precision=bf16 (or auto on a device with native bf16), or train.float8=none")
    if device_type != "cuda":
        return
    capability = torch.cuda.get_device_capability()
    if capability < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name()
        raise SpecError("train.float8", f"is {recipe}, but {name} (compute capability "
                        f"{capability[0]}.{capability[1]}) has no FP8 tensor cores (8.9 and up: L4, L40S, H100, H200, "
                        "B200)",
                        "set train.float8=none (bf16) on this GPU, or train on an FP8-capable one")


def takes_float8(name: str, module: nn.Module) -> bool:
    """Whether a block's submodule (`name` relative to the block) is converted: an `nn.Linear` with both dimensions
    multiples of 16, not a router."""
    return (type(module) is nn.Linear and name.rsplit(".", 1)[-1] not in HIGH_PRECISION_NAMES
            and module.in_features % FLOAT8_DIM_MULTIPLE == 0 and module.out_features % FLOAT8_DIM_MULTIPLE == 0)


def float8_all_gather(recipe: Float8Recipe, device_type: str) -> bool:
    """Whether FSDP2 all-gathers the converted weights in float8: tensorwise scaling on NCCL (cuda) only."""
    return recipe == "tensorwise" and device_type == "cuda"


def convert_blocks_to_float8(model: nn.Module, recipe: Float8Recipe, precision: str, device_type: str) -> int:
    """Swap each decoder block's eligible `nn.Linear` for torchao's `Float8Linear` (in place, before FSDP2 wraps the
    blocks); returns how many were converted. Float8 all-gather as `float8_all_gather` says; refusals as
    `check_float8_device`."""
    if recipe == "none":
        return 0
    check_float8_device(recipe, precision, device_type)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:  # an image with its own torch and no torchao (bench/RESULTS-gpu.md: carry the wheel)
        raise SpecError("train.float8", f"is {recipe}, but torchao's float8 training does not import here ({e})",
                        "install torchao>=0.18 (a shardline dependency) beside this torch, or set "
                        "train.float8=none") from e

    if recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=float8_all_gather(recipe, device_type))
    else:
        config = Float8LinearConfig.from_recipe_name(recipe)
    converted = 0
    for block in decoder_layers(model):
        eligible = {name for name, module in block.named_modules() if takes_float8(name, module)}
        converted += len(eligible)
        convert_to_float8_training(block, config=config,
                                   module_filter_fn=lambda module, fqn, eligible=eligible: fqn in eligible)
    if not converted:
        raise SpecError("train.float8", f"is {recipe}, but no decoder block has a linear layer whose dimensions are "
                        f"multiples of {FLOAT8_DIM_MULTIPLE} (float8 matmuls need them)",
                        "set train.float8=none, or use a model whose hidden and intermediate sizes are multiples of 16")
    return converted


def float8_linears(model: nn.Module) -> int:
    """How many of `model`'s modules multiply in float8 (torchao's `Float8Linear`); 0 without importing torchao."""
    return sum(1 for module in model.modules() if type(module).__name__ == "Float8Linear")


def uses_float8_all_gather(model: nn.Module) -> bool:
    """Whether any weight of `model` is all-gathered in float8 (torchao's float8-cast weight subclass)."""
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        if type(local).__name__ == "WeightWithDynamicFloat8CastTensor":
            return True
    return False


def float8_line(model: nn.Module, recipe: Float8Recipe) -> str:
    """The setup line of a float8 run: what multiplies in float8, how weights are gathered, what MFU counts."""
    gloo = "" if recipe == "rowwise" else " (gloo has no float8 all-gather)"
    gather = ("in float8 (FSDP2 float8 all-gather)" if uses_float8_all_gather(model)
              else f"in bf16, cast to float8 after{gloo}")
    return (f"float8 ({recipe} scaling, torchao): {float8_linears(model)} block linear layers multiply in float8, "
            f"everything else in bf16; weights all-gathered {gather}; MFU is against the bf16 peak (a GPU's "
            "float8 peak is twice that: the same step at 2× bf16's speed would read 2× the MFU)")


def precompute_float8_scales(model: nn.Module) -> None:
    """After an optimizer step with float8 all-gather: every converted weight's scale in one all-reduce (torchao's
    `precompute_float8_dynamic_scale_for_fsdp`) instead of one per weight inside the next all-gathers."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
