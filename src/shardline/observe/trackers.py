"""Optional experiment trackers fed the same records as metrics.jsonl: TensorBoard and Weights & Biases.

Both are off by default. TensorBoard writes event files under `<run>/tensorboard/` and never opens a
connection. W&B runs in `offline` mode unless `observe.wandb_mode: online` says otherwise, so nothing
leaves the machine without being asked to. Whether the packages are installed is checked where training
starts (shardline/environment.py), not when the spec is validated.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardline.spec import JobSpec

# Record fields that are not series: identity, bookkeeping, or strings.
NOT_SCALARS = {"kind", "time", "step", "event", "location", "blocking", "n", "formula", "peak_source", "params",
               "dataset_version", "signal", "rng_restored"}


def scalars(kind: str, record: dict) -> tuple[int | None, dict[str, float]]:
    """The step and the numeric series of one record, named `<kind>/<field>` (events: `<event>/<field>`)."""
    group = record.get("event", kind) if kind in ("event", "checkpoint") else kind
    flat = {f"{k}.{inner}" if isinstance(v, dict) else k: w for k, v in record.items() if k not in NOT_SCALARS
            for inner, w in (v.items() if isinstance(v, dict) else [(None, v)])}  # DPO's `preference` means
    values = {f"{group}/{k}": float(v) for k, v in flat.items()
              if isinstance(v, int | float) and not isinstance(v, bool)}
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
