"""AdamW with decoupled weight decay on matrices only, and linear warmup + cosine decay."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from shardline.spec import TrainSpec


def build_optimizer(model: nn.Module, spec: TrainSpec, device: torch.device) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]  # norms and biases are not decayed
    groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def lr_factor(step: int, spec: TrainSpec) -> float:
    """Multiplier of `spec.lr` for optimizer step `step` (0-based): linear warmup, then cosine to min."""
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.max_steps - spec.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return spec.min_lr_ratio + (1.0 - spec.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, spec: TrainSpec) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, spec))
