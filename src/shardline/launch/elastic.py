"""Elastic node counts (`launch.min_nnodes`): torchrun `--nnodes=min:max` with c10d rendezvous.

The job starts with up to `launch.nnodes` nodes and keeps going while at least `min_nnodes` are up:
when a node is lost, torchrun on the others restarts the worker group (`launch.max_restarts`), the
rendezvous admits whoever is left, and the trainer resumes from the last committed checkpoint at the
new world size (DCP reshards; the step's global batch stays the same, accumulation absorbs the change).
The rendezvous endpoint is the first node's address:29500: Slurm exports it as `PET_RDZV_ENDPOINT` (torchrun
reads it as the flag's default), Kubernetes renders pod 0's stable DNS name into `--rdzv-endpoint`. Without
one, every node would host its own c10d store and rendezvous with itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardline.errors import SpecError

if TYPE_CHECKING:
    from shardline.spec import JobSpec


def is_elastic(spec: JobSpec) -> bool:
    return spec.launch.min_nnodes is not None and spec.launch.min_nnodes < spec.launch.nnodes


def node_counts(spec: JobSpec) -> range:
    low = spec.launch.min_nnodes if is_elastic(spec) else spec.launch.nnodes
    return range(low, spec.launch.nnodes + 1)


def allowed_world_sizes(spec: JobSpec) -> list[int]:
    return [n * (spec.parallel.nproc_per_node or 1) for n in node_counts(spec)]


def torchrun_node_flags(spec: JobSpec, rdzv_endpoint: str | None = None) -> list[str]:
    """`--nnodes` and, when elastic, the c10d rendezvous at `rdzv_endpoint` (host:port; None: the engine
    exports PET_RDZV_ENDPOINT)."""
    if not is_elastic(spec):
        return [f"--nnodes={spec.launch.nnodes}"]
    endpoint = [f"--rdzv-endpoint={rdzv_endpoint}"] if rdzv_endpoint else []
    return [f"--nnodes={spec.launch.min_nnodes}:{spec.launch.nnodes}", "--rdzv-backend=c10d", *endpoint,
            f"--rdzv-id={spec.run.id or spec.run.name}"]


def check_elastic(spec: JobSpec) -> None:
    lo, hi = spec.launch.min_nnodes, spec.launch.nnodes
    if lo is None:
        return
    if lo > hi:
        raise SpecError("launch.min_nnodes", f"{lo} is more than launch.nnodes={hi}",
                        f"use a value from 1 to {hi} (nnodes is the most nodes the job runs on)")
    p, t = spec.parallel, spec.train
    if lo < hi and (p.dp_replicate != 1 or p.dp_shard is not None):
        raise SpecError("parallel.dp_replicate", "HSDP fixes the world size, but launch.min_nnodes lets it change",
                        "use plain FSDP (dp_replicate 1, dp_shard null) for elastic jobs")
    for world in allowed_world_sizes(spec):
        if t.global_batch_size % (world * t.micro_batch_size):
            raise SpecError("train.global_batch_size", f"{t.global_batch_size} is not divisible by world size × "
                            f"micro-batch = {world} × {t.micro_batch_size} for {world // (p.nproc_per_node or 1)} "
                            "nodes, a size this elastic job may run at",
                            "make it a multiple of every world size from launch.min_nnodes to launch.nnodes")
