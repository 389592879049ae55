"""Where a training step makes the host wait for the device, counted on any device (the CPU included).

On a GPU a host read of device data (`.item()`, `float(t)`, `bool(t)`, an op whose output size depends on the
data: `nonzero`, boolean indexing, `unique`) blocks until every queued kernel has run. `torch.cuda.set_sync_debug_mode`
reports these on CUDA only; `HostReads` finds the same points on the CPU by following which tensors hold device
data: parameters, buffers and their gradients, the batch as moved to the device (`mark`), whatever a collective
touches (NCCL runs on the device), and every op's outputs when an input is one of those. A host read of such a
tensor (a scalar read, a copy `.to("cpu")`, a data-dependent shape) is a synchronisation point on a GPU; a read
of a tensor built on the host (span indices, optimizer step counters on the CPU) is not, and is not counted."""

from __future__ import annotations

import traceback
import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Ops that read device data on the host, or whose output shape depends on it
HOST_READ_OPS = frozenset({
    "aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.equal.default", "aten.nonzero.default",
    "aten.masked_select.default", "aten.repeat_interleave.Tensor", "aten._unique2.default", "aten.unique_dim.default",
    "aten.unique_consecutive.default", "aten.index.Tensor",
})  # not nonzero_static: its output size is given, so the host never waits for it


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class HostReads(TorchDispatchMode):
    """`sites`: a Counter of (op, shardline or transformers file:line) for every host read of device data."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self._device: dict[int, weakref.ref] = {}  # by id: a tensor's == is elementwise
        self.sites: Counter = Counter()
        self.mark(*model.parameters(), *model.buffers())

    def mark(self, *tensors: torch.Tensor) -> None:
        """These tensors live on the device (a batch after `.to(device)`, say)."""
        for t in tensors:
            self._device[id(t)] = weakref.ref(t)
            local = getattr(t, "_local_tensor", None)  # a DTensor's shard is the device data
            if local is not None:
                self._device[id(local)] = weakref.ref(local)
            if t.grad is not None:
                self.mark(t.grad)

    def _on_device(self, t: torch.Tensor) -> bool:
        return any(self._device.get(id(x), lambda: None)() is x for x in (t, t._base) if x is not None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        name = str(func)
        device = any(self._on_device(t) for t in inputs)
        boolean_index = name == "aten.index.Tensor" and any(
            t is not None and t.dtype == torch.bool for t in (args[1] if len(args) > 1 else []))
        to_host = name == "aten._to_copy.default" and kwargs.get("device") == torch.device("cpu")  # `.to("cpu")`
        if device and (to_host or name in HOST_READ_OPS and (name != "aten.index.Tensor" or boolean_index)):
            self.sites[(name.removeprefix("aten.").removesuffix(".default"), _caller())] += 1
        out = func(*args, **kwargs)
        if device or name.startswith("c10d."):  # a collective's tensors are on the device
            for t in _tensors(out) + (inputs if name.startswith("c10d.") else []):
                self.mark(t)
        return out

    @property
    def total(self) -> int:
        return sum(self.sites.values())


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/shardline/" in frame.filename or "/transformers/" in frame.filename:
            return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "?"
