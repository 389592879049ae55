"""What a checkpoint holds besides weights: counters, scheduler, and each rank's RNG streams."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from shardline.train.checkpoint import pack_object, unpack_object


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def state_dict_options(model: nn.Module) -> StateDictOptions:
    """With LoRA only trainable (adapter) weights are saved; the base is rebuilt from the spec, so loading
    must not insist on the frozen keys."""
    lora = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, counters: dict[str, Any],
                   rank: int) -> dict[str, Any]:
    """The DCP state dict: sharded model/optimizer, shared counters, this rank's RNG under its own key."""
    opts = state_dict_options(model)
    if optimizer is None:
        return {"model": get_state_dict(model, [], options=opts)[0]}
    msd, osd = get_state_dict(model, optimizer, options=opts)
    return {"model": msd, "optim": osd, "train": counters, f"rng_rank{rank}": pack_object(rng_state())}


def apply_training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any],
                         rank: int) -> bool:
    """Push a loaded state dict into model/optimizer/RNG; returns whether this rank's RNG was restored."""
    opts = state_dict_options(model)
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=opts)
        return False
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=opts)
    key = f"rng_rank{rank}"
    if key in state:
        set_rng_state(unpack_object(state[key]))
        return True
    return False
