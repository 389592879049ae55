"""Stage a model directory once per node (`model.local_cache`), e.g. from a GCS FUSE mount to local SSD.

Local rank 0 of each node copies the weights and tokenizer files into `<local_cache>/<name>-<hash>/`
through a temporary directory renamed into place under a file lock (nodes sharing the cache path copy
once); the other ranks wait at a barrier and every rank then loads from the local copy.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from shardline.errors import SpecError
from shardline.spec import ModelSpec

COMPLETE = ".shardline-staged"


def staged_path(spec: ModelSpec) -> Path:
    source = Path(spec.path).expanduser().resolve()
    digest = hashlib.sha256(str(source).encode()).hexdigest()[:12]
    return Path(spec.local_cache).expanduser() / f"{source.name}-{digest}"


def stage(spec: ModelSpec) -> Path:
    """Copy `spec.path` into the cache unless a complete copy is there; returns the local directory."""
    source = Path(spec.path).expanduser()
    if not source.is_dir():
        raise SpecError("model.local_cache", f"needs model.path to be a directory, got {spec.path!r}",
                        "point model.path at a mounted or downloaded checkpoint directory")
    target = staged_path(spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f".{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / COMPLETE).exists():
            tmp = target.parent / f".tmp-{target.name}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(source, tmp)
            (tmp / COMPLETE).write_text(str(source.resolve()))
            shutil.rmtree(target, ignore_errors=True)
            os.rename(tmp, target)
    return target


def staged_model_spec(spec: ModelSpec, local_rank: int) -> ModelSpec:
    """The model spec to build from: `path` replaced by the node-local copy when a cache is set."""
    if spec.local_cache is None or spec.path is None:
        return spec
    if local_rank == 0:
        stage(spec)
    dist.barrier()
    return spec.model_copy(update={"path": str(staged_path(spec))})
