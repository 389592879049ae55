"""What a checkpoint holds besides weights: counters, scheduler, each rank's RNG streams, and whose streams a rank
restores when the parallel layout changed."""

from __future__ import annotations

import math
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

from shardline.parallel.fsdp import data_parallel_rank

PYTHON_RNG_VERSION = 3
RNG_STREAMS = {"python", "python_gauss", "numpy", "numpy_pos", "numpy_gauss", "torch"}


def rng_state() -> dict[str, torch.Tensor]:
    """This process's random streams as tensors (no pickles in a checkpoint)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    if version != PYTHON_RNG_VERSION or kind != "MT19937":
        raise RuntimeError(f"unexpected RNG state layout: python v{version}, numpy {kind}")
    state = {
        "python": torch.tensor(internal, dtype=torch.int64),
        "python_gauss": torch.tensor([math.nan if gauss is None else gauss], dtype=torch.float64),
        "numpy": torch.from_numpy(keys.astype(np.int64)),
        "numpy_pos": torch.tensor([pos, has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([cached], dtype=torch.float64),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    gauss = float(state["python_gauss"][0])
    random.setstate((PYTHON_RNG_VERSION, tuple(int(v) for v in state["python"].tolist()),
                     None if math.isnan(gauss) else gauss))
    pos, has_gauss = (int(v) for v in state["numpy_pos"].tolist())
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), pos, has_gauss,
                         float(state["numpy_gauss"][0])))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def rng_source_rank(rank: int, world: int, ranks_per_row: int, saved_world: int, saved_per_row: int) -> int | None:
    """The saved rank whose RNG streams `rank` restores; None: none, it keeps the fresh streams it was seeded with
    (`train.seed` + its data-parallel index).

    Streams belong to data-parallel ranks: tensor- and context-parallel peers (`ranks_per_row` consecutive ranks) draw
    the same dropout masks. On the layout the checkpoint was saved with (world size and ranks per row), every rank
    restores its own streams: an exact resume. On another layout, a rank restores those of the first saved rank with
    its data-parallel index, so peers restore one stream; an index the checkpoint lacks (more data-parallel ranks
    than were saved) starts fresh."""
    if (world, ranks_per_row) == (saved_world, saved_per_row):
        return rank
    dp_rank, _ = data_parallel_rank(rank, world, ranks_per_row)
    return dp_rank * saved_per_row if dp_rank < saved_world // saved_per_row else None


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
    return {"model": msd, "optim": osd, "train": counters, f"rng_rank{rank}": rng_state()}


def apply_training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any],
                         rank: int) -> bool:
    """Push a loaded state dict into model/optimizer/RNG; returns whether this rank's RNG was restored (the streams
    `Checkpointer.load` put under its key, `rng_source_rank`'s choice)."""
    opts = state_dict_options(model)
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=opts)
        return False
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=opts)
    streams = state.get(f"rng_rank{rank}", {})
    if set(streams) >= RNG_STREAMS:
        set_rng_state(streams)
        return True
    return False
