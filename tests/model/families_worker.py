"""torchrun worker for tests/model/test_families.py (a script; pytest does not collect it).

    torchrun --standalone --nproc-per-node=2 tests/model/families_worker.py JOBS.json

For each job (a family's spec): one Trainer step on this rank's share of the global batch; rank 0 writes the
logged loss and each rank's rows to `<out>.json` and the full parameters and first moments after the step to `<out>`
(safetensors).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from rich.console import Console
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from shardline.data.prepare import prepare
from shardline.parallel.mesh import distributed
from shardline.rundir import run_path
from shardline.spec import JobSpec
from shardline.training.trainer import Trainer
from shardline.worker import exit_without_teardown

MOMENT = "exp_avg."
"""Key prefix of the first moments (the step's gradients × (1 − β1)) beside the weights in the output file."""


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def main(jobs_file: str) -> None:
    with distributed() as ctx:
        for job in json.loads(Path(jobs_file).read_text()):
            spec = JobSpec.model_validate_json(job["spec"])  # created by the test: the run directory exists
            run_dir = run_path(spec)
            trainer = Trainer(spec, ctx, prepare(spec), run_dir, Console(quiet=True))
            record = trainer.train_step()
            rows = [None] * ctx.world
            mine = [r for line in trainer.sample_trace.read_text().splitlines() for r in json.loads(line)["rows"]]
            dist.all_gather_object(rows, mine)
            named = list(trainer.model.named_parameters())
            params = {n: _full(p).detach().contiguous() for n, p in named}
            params |= {f"{MOMENT}{n}": _full(trainer.optimizer.state[p]["exp_avg"]).contiguous() for n, p in named}
            if ctx.is_main:
                out = Path(job["out"])
                out.with_suffix(".json").write_text(json.dumps({"loss": record.loss, "rows_by_rank": rows}))
                save_file(params, out)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_teardown(0)  # gloo's threads can abort interpreter finalisation (shardline.worker)
