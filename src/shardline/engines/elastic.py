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

if TYPE_CHECKING:
    from shardline.spec import JobSpec


def torchrun_node_flags(spec: JobSpec, rdzv_endpoint: str | None = None) -> list[str]:
    """`--nnodes` and, when elastic, the c10d rendezvous at `rdzv_endpoint` (host:port; None: the engine
    exports PET_RDZV_ENDPOINT)."""
    if not spec.is_elastic:
        return [f"--nnodes={spec.launch.nnodes}"]
    endpoint = [f"--rdzv-endpoint={rdzv_endpoint}"] if rdzv_endpoint else []
    return [f"--nnodes={spec.launch.min_nnodes}:{spec.launch.nnodes}", "--rdzv-backend=c10d", *endpoint,
            f"--rdzv-id={spec.run.id or spec.run.name}"]
