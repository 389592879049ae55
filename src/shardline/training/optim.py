"""AdamW with decoupled weight decay on matrices only, and linear warmup + cosine decay."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor.experimental import implicit_replication
from torch.optim.lr_scheduler import LambdaLR

from shardline.model.float8 import precompute_float8_scales, uses_float8_all_gather
from shardline.spec import TrainSpec


def build_optimizer(model: nn.Module, spec: TrainSpec, device: torch.device) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]  # norms and biases are not decayed
    groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    if uses_float8_all_gather(model):  # `train.float8: tensorwise` on NCCL: next step's scales in one all-reduce
        optimizer.register_step_post_hook(lambda *_: precompute_float8_scales(model))
    return optimizer


def lr_factor(step: int, spec: TrainSpec) -> float:
    """Multiplier of `spec.lr` for optimizer step `step` (0-based): linear warmup, then cosine to min."""
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.max_steps - spec.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return spec.min_lr_ratio + (1.0 - spec.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, spec: TrainSpec) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, spec))


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's `clip_grad_norm_` (L2, foreach) over parameters on several device meshes: with tensor parallel the
    blocks' projections live on (dp × tp) and the replicated rest on dp alone, and one norm cannot mix them.
    Each mesh's norm is completed over its own ranks, then combined; returns the total norm (a plain tensor)."""
    grads: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            grads.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    norms = []
    for group in grads.values():
        norm = torch.nn.utils.get_total_norm(group, 2.0, foreach=True)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.stack(norms).norm(2.0) if norms else torch.zeros(())
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    with implicit_replication():  # the plain coefficient multiplies each mesh's gradients alike
        for group in grads.values():
            torch._foreach_mul_(group, coef.to(group[0].device))
    return total
