"""One rank of a world of any size, on this CPU: a fake process group and fake (storage-less) tensors.

The only module that touches torch's private simulation APIs (`torch.testing._internal`,
`torch.distributed._tools`); `tests/train/test_dry_run.py` pins them, naming the torch version when an
upgrade moves them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from shardline.errors import ShardlineError

PRIVATE_APIS = (
    "torch.testing._internal.distributed.fake_pg.FakeStore",
    "torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker",
    "torch._subclasses.fake_tensor.FakeTensorMode",
    "torch._subclasses.fake_tensor.unset_fake_temporarily",
)


def _import(path: str):
    module, name = path.rsplit(".", 1)
    try:
        return getattr(__import__(module, fromlist=[name]), name)
    except (ImportError, AttributeError) as e:
        raise ShardlineError("plan --dry-run", f"torch {torch.__version__} lacks {path}, which the simulation "
                             f"uses ({e})", "install the torch of scripts/torch-version, or plan without "
                             "--dry-run") from e


def fake_store():
    return _import(PRIVATE_APIS[0])()


def mem_tracker_class():
    return _import(PRIVATE_APIS[1])


def fake_tensor_mode():
    """Fake tensors that real (meta-built, then emptied) modules and their inputs may mix with."""
    return _import(PRIVATE_APIS[2])(allow_non_fake_inputs=True)


def outside_fake_mode():
    """A context in which new tensors are real again while fake ones stay fake (their own mode runs their ops): for
    the host integers a step reads (expert parallel's dispatch splits), computed for real beside fake activations."""
    return _import(PRIVATE_APIS[3])()


@contextmanager
def fake_process_group(world: int, rank: int) -> Iterator[None]:
    """The process-global default group as rank `rank` of `world`; collectives move no data, except that
    `all_to_all_single` returns a rank's own input (torch's fake group copies it): each rank is taken to receive what
    it sends, which is the exchange of balanced routing (`simulation.balanced_routing`)."""
    if not 0 <= rank < world:
        raise ShardlineError("--rank", f"{rank} is not a rank of world {world}", f"choose 0…{world - 1}")
    if dist.is_initialized():
        raise ShardlineError("plan --dry-run", "a process group is already initialised in this process",
                             "run the simulation in its own process (python -m shardline.planning.simulation.dry_run)")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
