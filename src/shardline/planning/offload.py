"""What `parallel.offload` costs: the host memory it needs and a modelled slowdown (not measured: no GPU here).

FSDP2's CPU offload keeps every rank's parameter, gradient and AdamW shards in host memory. Per micro-batch each
parameter shard crosses PCIe to the GPU twice (forward and backward all-gathers) and each gradient shard comes back
once (fp32); the AdamW step runs on the host. Modelled without overlap (an upper bound on the slowdown):

- PCIe: `PCIE_GBPS` per GPU, one direction, pinned host memory: what a PCIe Gen4 x16 link sustains in practice
  (~80 % of its 32 GB/s); a Gen5 host (H100, H200, B200 nodes) reaches about twice that.
- host AdamW (torch's foreach, unfused on the CPU): `HOST_ADAM_PARAMS_PER_S` per rank, 8 threads at the ~63 M
  parameters/s one thread of the development machine's EPYC measured (8 M fp32 parameters, 2026-11-28).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardline.planning.memory import MemoryPlan
    from shardline.spec import JobSpec

PCIE_GBPS = 25.0
HOST_ADAM_PARAMS_PER_S = 8 * 63e6


@dataclass(frozen=True)
class OffloadCost:
    host_bytes_per_node: int
    transfer_s: float
    """Seconds per step on PCIe: parameter shards to the GPU, gradient shards back."""
    optimizer_s: float
    """Seconds per step of the AdamW step on the host."""

    @property
    def added_s(self) -> float:
        return self.transfer_s + self.optimizer_s

    def describe(self, step_s: float) -> str:
        """Host memory and the slowdown over `step_s` (the step without offload), as `plan` prints them."""
        return (f"host memory {self.host_bytes_per_node / 2**30:,.0f} GiB per node; modelled slowdown "
                f"×{(step_s + self.added_s) / step_s:.2g} (+{self.transfer_s:.3g} s/step over PCIe at {PCIE_GBPS:g} "
                f"GB/s, +{self.optimizer_s:.3g} s/step of AdamW on the host)")


def offload_cost(spec: JobSpec, on_device: MemoryPlan) -> OffloadCost:
    """The cost of offloading `spec`'s state, from `on_device`: its plan without offload (the shards offload moves:
    fp32 masters of what trains and the frozen base in the compute dtype, fp32 gradients, AdamW's two moments)."""
    t, p = spec.train, spec.parallel
    micro_batches = t.global_batch_size // (spec.world_size // p.ranks_per_row * t.micro_batch_size)
    shard = on_device.optimizer / 8  # trainable parameters per rank (AdamW: 8 bytes each)
    host = on_device.params + 4 * shard + on_device.optimizer  # the peak moment may hold no gradients: all of them
    transfers = micro_batches * (2 * on_device.params + 4 * shard)
    return OffloadCost(int(host * (p.nproc_per_node or 1)), transfers / (PCIE_GBPS * 1e9),
                       shard / HOST_ADAM_PARAMS_PER_S)
