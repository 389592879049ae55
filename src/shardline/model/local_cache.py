"""Stage a model directory once per node (`model.local_cache`), e.g. from a GCS FUSE mount to local SSD.

Local rank 0 of each node copies the weights and tokenizer files into `<local_cache>/<name>-<hash>/`
through a temporary directory renamed into place under a file lock (nodes sharing the cache path copy
once); the other ranks wait at a barrier and every rank then loads from the local copy. The hash is of
the source's content (small files hashed, large ones by size and mtime), so a changed source is staged
again and the copy of its old content is removed.
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
SMALL_FILE = 1 << 20
"""Files up to this size (config, tokenizer, weight index) are hashed; larger ones are keyed by size and mtime."""


def source_fingerprint(source: Path) -> str:
    """sha256 of the source path and, per file, its relative name and content (small) or size and mtime."""
    digest = hashlib.sha256(str(source).encode())
    for folder, dirs, names in os.walk(source, followlinks=True):  # as copytree copies: links followed
        dirs.sort()
        for name in sorted(names):
            path = Path(folder) / name
            st = path.stat()
            digest.update(f"{path.relative_to(source)}\0{st.st_size}\0".encode())
            digest.update(path.read_bytes() if st.st_size <= SMALL_FILE else str(st.st_mtime_ns).encode())
    return digest.hexdigest()[:12]


def staged_path(spec: ModelSpec) -> Path:
    source = Path(spec.path).expanduser().resolve()
    return Path(spec.local_cache).expanduser() / f"{source.name}-{source_fingerprint(source)}"


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
            _remove_older_copies(target, source.resolve())
    return target


def _remove_older_copies(target: Path, source: Path) -> None:
    """Copies of earlier content of the same source only fill the local disk: nothing loads them again."""
    for other in target.parent.glob(f"{source.name}-*"):
        marker = other / COMPLETE
        if other != target and marker.is_file() and marker.read_text() == str(source):
            shutil.rmtree(other, ignore_errors=True)


def staged_model_spec(spec: ModelSpec, local_rank: int) -> ModelSpec:
    """The model spec to build from: `path` replaced by the node-local copy when a cache is set."""
    if spec.local_cache is None or spec.path is None:
        return spec
    if local_rank == 0:
        stage(spec)
    dist.barrier()
    return spec.model_copy(update={"path": str(staged_path(spec))})
