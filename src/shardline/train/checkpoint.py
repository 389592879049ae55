"""Sharded DCP checkpoints: async or sync, committed atomically, retained, on a path or an fsspec URL.

A checkpoint `step-XXXXXXXX/` counts only once `COMMITTED` exists. Rank 0 writes it after its save
finished; DCP's coordinator (rank 0) writes `.metadata` only after every rank reported its shard
written, so rank 0 finishing means every rank finished. A run killed mid-save (or a full disk) leaves
a directory without the marker, which is never loaded and never causes an older one to be deleted.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.core import url_to_fs

from shardline.spec import CheckpointSpec

log = logging.getLogger("shardline")
COMMITTED = "COMMITTED"
STEP_PREFIX = "step-"


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


class CheckpointStore:
    """Checkpoint directories under a local path or an fsspec URL (s3://, gs://, …)."""

    def __init__(self, location: str) -> None:
        self.location = location.rstrip("/")
        self.fs, self.root = url_to_fs(self.location)
        self.remote = "://" in location and not location.startswith("file://")

    def path(self, step: int) -> str:
        return f"{self.location}/{step_name(step)}"

    def _fs_path(self, step: int) -> str:
        return f"{self.root}/{step_name(step)}"

    def writer(self, step: int) -> dcp.StorageWriter:
        if self.remote:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            return FsspecWriter(self.path(step), sync_files=False)
        Path(self.path(step)).mkdir(parents=True, exist_ok=True)
        return dcp.FileSystemWriter(self.path(step), sync_files=True)

    def reader(self, step: int) -> dcp.StorageReader:
        if self.remote:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            return FsspecReader(self.path(step))
        return dcp.FileSystemReader(self.path(step))

    def steps(self) -> list[int]:
        """All step directories, committed or not."""
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []
        return sorted(int(n.removeprefix(STEP_PREFIX)) for n in names
                      if n.startswith(STEP_PREFIX) and n.removeprefix(STEP_PREFIX).isdigit())

    def is_committed(self, step: int) -> bool:
        return self.fs.exists(f"{self._fs_path(step)}/{COMMITTED}")

    def committed(self) -> list[int]:
        return [s for s in self.steps() if self.is_committed(s)]

    def latest(self) -> int | None:
        done = self.committed()
        return done[-1] if done else None

    def write_text(self, step: int, name: str, text: str) -> None:
        path = f"{self._fs_path(step)}/{name}"
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        with self.fs.open(path, "w") as f:
            f.write(text)

    def read_text(self, step: int, name: str) -> str:
        with self.fs.open(f"{self._fs_path(step)}/{name}", "r") as f:
            return f.read()

    def delete(self, step: int) -> None:
        # The marker goes first, so a half-deleted directory never looks committed.
        marker = f"{self._fs_path(step)}/{COMMITTED}"
        if self.fs.exists(marker):
            self.fs.rm(marker)
        self.fs.rm(self._fs_path(step), recursive=True)


def retained(committed: list[int], keep_last: int, keep_every: int | None) -> set[int]:
    keep = set(committed[-keep_last:])
    if keep_every:
        keep |= {s for s in committed if s % keep_every == 0}
    return keep


@dataclass
class _Pending:
    step: int
    future: Future
    started: float
    files: dict[str, str]


class Checkpointer:
    """Saves and loads the trainer's state; at most one async save in flight."""

    def __init__(self, spec: CheckpointSpec, default_location: Path, on_gpu: bool) -> None:
        self.spec = spec
        self.store = CheckpointStore(spec.dir or str(default_location))
        self.rank = dist.get_rank()
        self.use_async = on_gpu if spec.async_save is None else spec.async_save
        # Background saves run their collectives on a separate gloo group, never the training one.
        self.group = dist.new_group(backend="gloo") if self.use_async else None
        self.pending: _Pending | None = None
        self.events: list[dict] = []

    # ---- saving --------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], files: dict[str, str], blocking: bool = False) -> float:
        """Start (async) or do (sync) a save; returns the seconds training was stalled."""
        start = time.perf_counter()
        self.wait()
        if self.use_async and not blocking:
            future = dcp.async_save(state, storage_writer=self.store.writer(step), process_group=self.group)
            self.pending = _Pending(step, future, start, files)
        else:
            dcp.save(state, storage_writer=self.store.writer(step))
            self._commit(step, start, files)
        return time.perf_counter() - start

    def poll(self) -> None:
        """Commit a finished background save (cheap; call at step boundaries)."""
        if self.pending is not None and self.pending.future.done():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight (if any) finished, then commit it."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        pending.future.result()
        self._commit(pending.step, pending.started, pending.files)

    def _commit(self, step: int, started: float, files: dict[str, str]) -> None:
        seconds = time.perf_counter() - started
        if self.rank == 0:
            for name, text in files.items():
                self.store.write_text(step, name, text)
            self.store.write_text(step, COMMITTED, json.dumps({"step": step, "time": time.time()}))
            self._apply_retention(step)
        self.events.append({"event": "checkpoint_committed", "step": step, "save_s": round(seconds, 3),
                            "location": self.store.path(step)})

    def _apply_retention(self, newest: int) -> None:
        committed = self.store.committed()
        keep = retained(committed, self.spec.keep_last, self.spec.keep_every)
        for step in self.store.steps():
            torn = step not in committed
            if step < newest and (torn or step not in keep):
                self.store.delete(step)
                log.info("deleted %s checkpoint %s", "torn" if torn else "old", step_name(step))

    # ---- loading -------------------------------------------------------------------------------
    def load(self, step: int, state: dict[str, Any]) -> dict[str, Any]:
        """Load `state` in place from a committed step; keys missing from the checkpoint are dropped
        only for the per-rank RNG entries (world size may have changed)."""
        reader = self.store.reader(step)
        present = {k.split(".", 1)[0] for k in reader.read_metadata().state_dict_metadata}
        state = {k: v for k, v in state.items() if k in present or not k.startswith("rng_rank")}
        dcp.load(state, storage_reader=reader)
        return state


def pack_object(obj: Any) -> io.BytesIO:
    """Opaque per-rank objects (RNG states) travel through DCP as bytes."""
    return io.BytesIO(pickle.dumps(obj))


def unpack_object(buf: io.BytesIO) -> Any:
    buf.seek(0)
    return pickle.loads(buf.read())  # noqa: S301 - written by this run's own ranks

