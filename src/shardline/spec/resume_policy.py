"""Which spec changes a resumed run survives.

- always: what does not change the training trajectory — world shape (DCP reshards; the data order
  depends only on step and global batch), parallelism, launch, checkpoint, logging, observability, cost,
  evaluation, where the run and its caches live (`run.dir`, `run.name`, `data.cache_dir`,
  `model.local_cache`: the dataset version and the weights are checked by content, not by path);
- with `checkpoint.allow_spec_change=true`: the optimisation schedule and micro-batching — the checkpoint
  still fits the model, but the run is no longer the same run;
- never: the model, the data (dataset version), seq len, global batch, data-order seed, precision.
"""

from __future__ import annotations

from shardline.errors import SpecError
from shardline.spec import JobSpec

ALWAYS = ("run.id", "run.dir", "run.name", "parallel.", "launch.", "checkpoint.", "observe.", "cost.",
          "data.cache_dir", "model.local_cache", "train.peak_tflops", "train.log_every", "train.eval_every",
          "train.eval_examples", "train.eval_max_new_tokens")
WITH_FLAG = ("train.lr", "train.min_lr_ratio", "train.warmup_steps", "train.max_steps", "train.weight_decay",
             "train.max_grad_norm", "train.micro_batch_size")


def _flatten(data: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def changed_fields(old: JobSpec, new: JobSpec) -> dict[str, tuple[object, object]]:
    a, b = _flatten(old.model_dump(mode="json")), _flatten(new.model_dump(mode="json"))
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


def check_resume(old: JobSpec, new: JobSpec) -> list[str]:
    """Raise `SpecError` if `new` cannot continue a run started with `old`; return the changed fields."""
    changes = {k: v for k, v in changed_fields(old, new).items() if not k.startswith(ALWAYS)}
    allowed = new.checkpoint.allow_spec_change
    blocked = [k for k in changes if not (allowed and k.startswith(WITH_FLAG))]
    if blocked:
        field = blocked[0]
        before, after = changes[field]
        flaggable = all(k.startswith(WITH_FLAG) for k in blocked)
        fix = ("add --set checkpoint.allow_spec_change=true to resume anyway" if flaggable else
               "start a new run (these settings change the model or the data the checkpoint belongs to)")
        raise SpecError(field, f"changed from {before!r} to {after!r} since the checkpoint "
                        f"(changed: {', '.join(blocked)})", fix)
    return list(changes)
