"""torchrun worker for tests/train/test_tensor_parallel.py and test_context_parallel.py (a script; pytest does not
collect it): several runs on one world, started once (a start, the imports of torch and transformers, is most of a
small run's time).

    torchrun --standalone --nproc-per-node=4 tests/train/world_worker.py JOBS.json

JOBS.json lists jobs, done in order; each names `spec`, the JSON file of a created run (its run directory exists):
- `"fit": true`: what `shardline train`'s workers do with the spec (`Trainer.fit`: resume if the spec says so, train,
  validate, checkpoint, generate), then the manifest records the run finished on its dataset;
- else: resume (if the spec says so), train `steps` steps, save a checkpoint if `save`, and with `out` compare every
  parameter that tensor parallel leaves whole (embeddings, a tied head, and what it replicates over the group: the
  sequence-parallel norms, the LoRA factor beside a split projection) across the ranks of each tensor-parallel group;
  rank 0 writes to `out`, per such parameter, the largest difference between peers (`peers`) and how far training
  moved it on rank 0 (`moved`: peers that match because nothing trains prove nothing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist
from rich.console import Console
from torch.distributed.tensor import DTensor, Replicate

from shardline.data.prepare import prepare
from shardline.parallel.mesh import DistContext, distributed
from shardline.rundir import create_run, run_path, update_manifest
from shardline.spec import JobSpec
from shardline.spec.resolve import load_spec
from shardline.training.trainer import Trainer
from shardline.worker import exit_without_teardown

REPO = Path(__file__).resolve().parents[2]


def created(runs: Path, *overrides: str) -> JobSpec:
    """The spec of a new run of the tiny model under `runs` (created: its run directory exists), `overrides` last."""
    from tests.conftest import small_overrides

    spec, _ = create_run(load_spec("tiny", [*small_overrides(runs), *overrides]))
    return spec


def run_world(root: Path, jobs: list[dict]) -> None:
    """`jobs` (each `spec` a created run's JobSpec) done in order on one torchrun world of their world size; the
    data is prepared here first, as `shardline train` prepares it before it starts the workers."""
    listed = []
    for i, job in enumerate(jobs):
        prepare(job["spec"])
        (root / f"job-{i}.json").write_text(job["spec"].model_dump_json())
        listed.append({**job, "spec": str(root / f"job-{i}.json")})
    (root / "jobs.json").write_text(json.dumps(listed))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={jobs[0]['spec'].world_size}", __file__, str(root / "jobs.json")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _whole_on_tp(p: DTensor) -> bool:
    """Not split by tensor parallel: no `tp` mesh dimension, or replicated over it (sequence-parallel norms and
    LoRA factors)."""
    names = p.device_mesh.mesh_dim_names
    return "tp" not in names or p.placements[names.index("tp")] == Replicate()


def _train(trainer: Trainer, ctx: DistContext, job: dict) -> None:
    trainer.maybe_resume()
    # this rank's FSDP shard of each such parameter: peers of one group hold the same data-parallel shard
    before = {n: p.to_local().detach().clone() for n, p in trainer.model.named_parameters() if _whole_on_tp(p)}
    for _ in range(job["steps"]):
        trainer.train_step()
    if job.get("save"):
        trainer.save_checkpoint(blocking=True)
    if not job.get("out"):
        return
    whole = {n: p.to_local() for n, p in trainer.model.named_parameters() if _whole_on_tp(p)}
    gathered = [None] * ctx.world
    dist.all_gather_object(gathered, {n: t.detach().cpu() for n, t in whole.items()})
    if ctx.is_main:
        tp = trainer.spec.parallel.tp
        peers = {n: max(float((gathered[r][n] - gathered[r - r % tp][n]).abs().max()) for r in range(ctx.world))
                 for n in whole}
        moved = {n: float((whole[n].detach() - before[n]).abs().max()) for n in whole}
        Path(job["out"]).write_text(json.dumps({"peers": peers, "moved": moved}))


def main(jobs_file: str) -> None:
    with distributed() as ctx:
        for job in json.loads(Path(jobs_file).read_text()):
            spec = JobSpec.model_validate_json(Path(job["spec"]).read_text())
            data = prepare(spec)  # the test prepared it: every rank opens the cache
            trainer = Trainer(spec, ctx, data, run_path(spec), Console(quiet=True))
            if job.get("fit"):
                trainer.fit()
                if ctx.is_main:
                    update_manifest(run_path(spec), status="finished", dataset_version=data.version)
            else:
                _train(trainer, ctx, job)
            dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_teardown(0)  # gloo's threads can abort interpreter finalisation (shardline.worker)
