"""Sharded DCP checkpoints with a commit marker written last (DESIGN.md §2).

A checkpoint directory counts only once `COMMITTED` exists; it is written by rank 0 after every rank
finished its shard, so a run killed mid-save never resumes from a torn checkpoint. With LoRA only the
trainable (adapter) weights are saved; the base is rebuilt from the spec.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

COMMITTED = "COMMITTED"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def latest_committed(root: Path) -> Path | None:
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step-*") if (p / COMMITTED).exists())
    return done[-1] if done else None


def _options(model: nn.Module) -> StateDictOptions:
    lora = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=lora)


def save(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         extra: dict[str, Any]) -> float:
    """Save synchronously on all ranks; returns the seconds it took."""
    start = time.perf_counter()
    path = step_dir(root, step)
    msd, osd = get_state_dict(model, optimizer, options=_options(model))
    dcp.save({"model": msd, "optim": osd, "extra": extra}, checkpoint_id=str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        (path / COMMITTED).write_text(json.dumps({"step": step, "time": time.time()}))
    dist.barrier()
    return time.perf_counter() - start


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
         extra: dict[str, Any]) -> dict[str, Any]:
    """Load into an already parallelized model (and optimizer); fills and returns `extra`."""
    opts = _options(model)
    if optimizer is None:
        msd = get_state_dict(model, [], options=opts)[0]
        state = {"model": msd, "extra": extra}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"], options=opts)
    else:
        msd, osd = get_state_dict(model, optimizer, options=opts)
        state = {"model": msd, "optim": osd, "extra": extra}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=opts)
    return state["extra"]
