"""Optional experiment trackers fed the same records as metrics.jsonl: TensorBoard and Weights & Biases.

Both are off by default. TensorBoard writes event files under `<run>/tensorboard/` and never opens a
connection. W&B runs in `offline` mode unless `observe.wandb_mode: online` says otherwise, so nothing
leaves the machine without being asked to.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from shardline.errors import SpecError

if TYPE_CHECKING:
    from shardline.spec import JobSpec

# Record fields that are not series: identity, bookkeeping, or strings.
NOT_SCALARS = {"kind", "time", "step", "event", "location", "blocking", "n", "formula", "peak_source", "params",
               "dataset_version", "signal", "rng_restored"}


def check_observe(spec: JobSpec) -> None:
    """Spec rules for the `observe` section (called from the spec's validator)."""
    o = spec.observe
    if o.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise SpecError("observe.tensorboard", "true, but the tensorboard package is not installed",
                        "pip install 'shardline[observe]', or set observe.tensorboard=false")
    if o.wandb_project is not None and importlib.util.find_spec("wandb") is None:
        raise SpecError("observe.wandb_project", f"{o.wandb_project!r} is set, but the wandb package is not "
                        "installed", "pip install wandb, or remove observe.wandb_project")
    if o.wandb_project is not None and not o.wandb_project.strip():
        raise SpecError("observe.wandb_project", "is empty", "name a W&B project, or use null to turn W&B off")


def scalars(kind: str, record: dict) -> tuple[int | None, dict[str, float]]:
    """The step and the numeric series of one record, named `<kind>/<field>` (events: `<event>/<field>`)."""
    group = record.get("event", kind) if kind in ("event", "checkpoint") else kind
    values = {f"{group}/{k}": float(v) for k, v in record.items()
              if k not in NOT_SCALARS and isinstance(v, int | float) and not isinstance(v, bool)}
    step = record.get("step")
    return (int(step) if isinstance(step, int | float) else None), values


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), flush_secs=10)

    def __call__(self, kind: str, record: dict) -> None:
        step, values = scalars(kind, record)
        if step is None:
            return
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step, walltime=record.get("time"))

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, spec: JobSpec, run_dir: Path) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=spec.observe.wandb_project, mode=spec.observe.wandb_mode, dir=str(run_dir),
                              name=spec.run.id, id=spec.run.id, resume="allow",
                              config=spec.model_dump(mode="json"))

    def __call__(self, kind: str, record: dict) -> None:
        step, values = scalars(kind, record)
        if step is not None and values:
            self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
