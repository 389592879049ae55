"""torchrun worker for tests/train/test_tensor_parallel.py (a script; pytest does not collect it).

    torchrun --standalone --nproc-per-node=4 tests/train/tp_worker.py SPEC.json STEPS OUT.json

Resumes from the checkpoint the spec names (`checkpoint.resume_from`), if any, trains STEPS steps of the spec (its
run directory exists), then compares every parameter that tensor parallel leaves whole (embeddings, a tied head, and
what it replicates over the group: the sequence-parallel norms, the LoRA factor beside a split projection) across the
ranks of each tensor-parallel group; rank 0 writes, per such parameter, the largest difference between peers
(`peers`) and how far training moved it on rank 0 (`moved`: peers that match because nothing trains prove nothing).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from rich.console import Console
from torch.distributed.tensor import DTensor, Replicate

from shardline.data.prepare import prepare
from shardline.parallel.mesh import distributed
from shardline.rundir import run_path
from shardline.spec import JobSpec
from shardline.training.trainer import Trainer
from shardline.worker import exit_without_teardown


def _whole_on_tp(p: DTensor) -> bool:
    """Not split by tensor parallel: no `tp` mesh dimension, or replicated over it (sequence-parallel norms and
    LoRA factors)."""
    names = p.device_mesh.mesh_dim_names
    return "tp" not in names or p.placements[names.index("tp")] == Replicate()


def main(spec_file: str, steps: int, out: str) -> None:
    with distributed() as ctx:
        spec = JobSpec.model_validate_json(Path(spec_file).read_text())
        trainer = Trainer(spec, ctx, prepare(spec), run_path(spec), Console(quiet=True))
        trainer.maybe_resume()
        # this rank's FSDP shard of each such parameter: peers of one group hold the same data-parallel shard
        before = {n: p.to_local().detach().clone() for n, p in trainer.model.named_parameters() if _whole_on_tp(p)}
        for _ in range(steps):
            trainer.train_step()
        whole = {n: p.to_local() for n, p in trainer.model.named_parameters() if _whole_on_tp(p)}
        gathered = [None] * ctx.world
        dist.all_gather_object(gathered, {n: t.detach().cpu() for n, t in whole.items()})
        if ctx.is_main:
            tp = spec.parallel.tp
            peers = {n: max(float((gathered[r][n] - gathered[r - r % tp][n]).abs().max()) for r in range(ctx.world))
                     for n in whole}
            moved = {n: float((whole[n].detach() - before[n]).abs().max()) for n in whole}
            Path(out).write_text(json.dumps({"peers": peers, "moved": moved}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    exit_without_teardown(0)  # gloo's threads can abort interpreter finalisation (shardline.worker)
