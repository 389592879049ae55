"""Process-group setup from torchrun's environment: cuda → NCCL, cpu → gloo."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shardline.errors import SpecError


@dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _attempt_store(timeout: timedelta) -> dist.Store:
    """The rendezvous store, namespaced by torchrun's restart count.

    torchrun keeps one TCPStore across `--max-restarts` attempts; without a per-attempt prefix a
    restarted rank can read a dead peer's gloo address from the previous attempt and fail to connect.
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
        is_master=not agent_store and int(os.environ["RANK"]) == 0, timeout=timeout,
    )
    return dist.PrefixStore(f"shardline/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


@contextmanager
def distributed(timeout_s: int = 1800) -> Iterator[DistContext]:
    """Join the process group torchrun (or a single-process run) describes; tear it down on exit.

    When the group already exists (Ray Train creates it before calling the worker), use it and leave
    its teardown to its owner."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        if local_rank >= (gpus := torch.cuda.device_count()):
            raise SpecError("parallel.nproc_per_node", f"local rank {local_rank} has no GPU of its own: this node "
                            f"shows {gpus}", f"start at most {gpus} processes per node (--nproc {gpus}); NCCL "
                            "cannot run two ranks on one GPU")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "cpu:gloo,cuda:nccl"  # gloo carries the small CPU-side collectives (objects, flags)
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if dist.is_initialized():
        yield DistContext(dist.get_rank(), local_rank, dist.get_world_size(), device)
        return
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, timeout=timeout, store=_attempt_store(timeout),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    try:
        yield DistContext(dist.get_rank(), local_rank, dist.get_world_size(), device)
    finally:
        dist.destroy_process_group()
