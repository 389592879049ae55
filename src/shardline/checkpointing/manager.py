"""Sharded DCP checkpoints: async or sync, committed atomically, checksummed, retained, on a path or URL.

A checkpoint `step-XXXXXXXX/` counts only once `COMMITTED` exists. Rank 0 writes it after its save
finished; DCP's coordinator (rank 0) writes `.metadata` only after every rank reported its shard
written (and hashed, `checkpoint_storage`), so rank 0 finishing means every rank finished. A run killed
mid-save (or a full disk) leaves a directory without the marker, which is never loaded and never causes
an older one to be deleted. Before a resume every file is checked against the hashes recorded when it was
written; a damaged checkpoint is skipped, with a warning, for the newest intact one.

The store of a run is `checkpoint.dir/<run.id>` (or `<run dir>/checkpoints`): runs sharing a bucket prefix
never see, resume or delete each other's checkpoints. Starting from another run's checkpoint is explicit:
`checkpoint.resume_from`.
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from shardline.checkpointing.state import rng_source_rank
from shardline.checkpointing.storage import (
    CHECKSUM_SUFFIX,
    ChecksummedFileSystemWriter,
    ChecksummedFsspecWriter,
    SafeFileSystemReader,
    SafeFsspecReader,
    WeightsOnlyLoadPlanner,
    checksum_lines,
    parse_checksums,
    sha256_stream,
)
from shardline.errors import ShardlineError
from shardline.resilience.faults import maybe_fail
from shardline.rundir import checkpoint_location, read_spec
from shardline.spec import CheckpointSpec, JobSpec
from shardline.spec.resolve import read_spec_file
from shardline.storage import filesystem_for

log = logging.getLogger("shardline")
COMMITTED = "COMMITTED"
STEP_PREFIX = "step-"
COORDINATOR_CHECKSUMS = f"commit{CHECKSUM_SUFFIX}"


class CheckpointWriteError(ShardlineError):
    """A save could not be completed (disk full, permissions); earlier checkpoints are untouched."""


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


class CheckpointStore:
    """Checkpoint directories under a local path or an fsspec URL (s3://, gs://, …)."""

    def __init__(self, location: str) -> None:
        self.location = location.rstrip("/")
        self.fs, self.root = filesystem_for(self.location, "checkpoint.dir")
        self.remote = "://" in location and not location.startswith("file://")

    def path(self, step: int) -> str:
        return f"{self.location}/{step_name(step)}"

    def _fs_path(self, step: int) -> str:
        return f"{self.root}/{step_name(step)}"

    def writer(self, step: int, after_write: Callable[[], None] | None = None) -> dcp.StorageWriter:
        if self.remote:
            return ChecksummedFsspecWriter(self.path(step), sync_files=False, after_write=after_write)
        Path(self.path(step)).mkdir(parents=True, exist_ok=True)
        return ChecksummedFileSystemWriter(self.path(step), sync_files=True, after_write=after_write)

    def reader(self, step: int) -> dcp.StorageReader:
        if self.remote:
            return SafeFsspecReader(self.path(step))
        return SafeFileSystemReader(self.path(step))

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

    def hash_file(self, step: int, name: str) -> str:
        with self.fs.open(f"{self._fs_path(step)}/{name}", "rb") as f:
            return sha256_stream(f)

    def files(self, step: int) -> list[str]:
        """Every file of a step directory, relative to it."""
        base = self._fs_path(step).rstrip("/") + "/"
        return sorted(p.removeprefix(base) for p in self.fs.find(base))

    def recorded_checksums(self, step: int) -> dict[str, str] | None:
        """File → SHA-256 recorded when the step was written; None for a checkpoint from before checksums."""
        lists = [n for n in self.files(step) if n.endswith(CHECKSUM_SUFFIX)]
        if COORDINATOR_CHECKSUMS not in lists:
            return None
        hashes: dict[str, str] = {}
        for name in lists:
            hashes |= parse_checksums(self.read_text(step, name), f"{self.path(step)}/{name}")
        return hashes

    def verify(self, step: int, rank: int = 0, world: int = 1) -> list[str]:
        """Problems found in this rank's share of the step's files (all of them with the defaults).

        Every file must be listed with the hash it had when written, and still have it. A step whose checksum list
        is unreadable, or missing although the step was written with one (it has the trainer's meta.json), is
        damaged: deleting or garbling the list must not turn verification off or stop a resume."""
        try:
            recorded = self.recorded_checksums(step)
        except (ShardlineError, OSError, UnicodeDecodeError) as e:
            return [f"{COORDINATOR_CHECKSUMS}: unreadable ({getattr(e, 'problem', e)})"] if rank == 0 else []
        if recorded is None:
            written_with_lists = "meta.json" in self.files(step)  # checkpoints from before checksums had neither
            return [f"{COORDINATOR_CHECKSUMS}: missing"] if written_with_lists and rank == 0 else []
        on_disk = [n for n in self.files(step) if not n.endswith(CHECKSUM_SUFFIX) and n != COMMITTED]
        problems = [f"{n}: no checksum was recorded for it" for n in on_disk if n not in recorded][rank::world]
        for name in sorted(recorded)[rank::world]:
            if name not in on_disk:
                problems.append(f"{name}: missing")
            elif self.hash_file(step, name) != recorded[name]:
                problems.append(f"{name}: content differs from the checksum recorded at commit")
        return problems

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


def parse_resume_from(value: str) -> tuple[str, int | None]:
    """`<run dir or checkpoint location>[@step]` → (location, step or None for the newest intact)."""
    location, sep, step = value.rpartition("@")
    if sep and step.isdigit():
        return location, int(step)
    return value, None


def checkpoint_spec(store: CheckpointStore, step: int) -> JobSpec | None:
    """The spec saved with a checkpoint (its weights belong to it); None for a checkpoint without one."""
    try:
        text = store.read_text(step, "spec.yaml")
    except FileNotFoundError:
        return None
    return read_spec_file(f"{store.path(step)}/spec.yaml", text)


def resume_source(value: str) -> tuple[CheckpointStore, int | None]:
    """The store `checkpoint.resume_from` names — a run directory (its own checkpoint location) or a checkpoint
    location — and the step it asks for (None: the newest intact)."""
    location, step = parse_resume_from(value)
    run_spec_file = Path(location) / "spec.yaml"
    if "://" not in location and run_spec_file.is_file():
        other = read_spec(run_spec_file)
        return CheckpointStore(checkpoint_location(other, Path(location))), step
    return CheckpointStore(location), step


def _rank_errors(error: BaseException) -> list[BaseException]:
    """The errors behind a DCP failure: each failed rank's own exception."""
    if isinstance(error, CheckpointException):
        return [exc for exc, _ in error.failures.values()]
    return [error]


def _plain(error: BaseException) -> Exception:
    """A DCP failure as what people should see: a rank's ShardlineError if one raised, else the text."""
    for exc in _rank_errors(error):
        if isinstance(exc, ShardlineError):
            return exc
    return error if isinstance(error, Exception) else RuntimeError(str(error))


def _disk_full(error: BaseException) -> bool:
    return any(_disk_full_one(e) for e in _rank_errors(error))


def _disk_full_one(error: BaseException) -> bool:
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(seen):  # DCP re-raises rank failures as text
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@dataclass
class _Pending:
    step: int
    future: Future
    started: float
    files: dict[str, str]


class Checkpointer:
    """Saves and loads the trainer's state; at most one async save in flight."""

    def __init__(self, spec: CheckpointSpec, location: str, on_gpu: bool) -> None:
        self.spec = spec
        self.store = CheckpointStore(location)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.use_async = on_gpu if spec.async_save is None else spec.async_save
        # Background saves run their collectives on a separate gloo group, never the training one.
        self.group = dist.new_group(backend="gloo") if self.use_async else None
        self.pending: _Pending | None = None
        self.events: list[dict] = []
        self.warnings: list[str] = []

    # ---- saving --------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], files: dict[str, str], blocking: bool = False) -> float:
        """Start (async) or do (sync) a save; returns the seconds training was stalled."""
        start = time.perf_counter()
        self.wait()
        writer = self.store.writer(step, after_write=lambda: maybe_fail("checkpoint_write", self.rank, step))
        if self.use_async and not blocking:
            future = dcp.async_save(state, storage_writer=writer, process_group=self.group)
            self.pending = _Pending(step, future, start, files)
        else:
            try:
                dcp.save(state, storage_writer=writer)
            except (Exception, CheckpointException) as e:
                self._write_failed(step, e)
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
        try:
            pending.future.result()
        except (Exception, CheckpointException) as e:
            self._write_failed(pending.step, e)
        self._commit(pending.step, pending.started, pending.files)

    def _write_failed(self, step: int, error: BaseException) -> None:
        """A save that raised: its directory is never committed; free it if the disk is full, then say so."""
        if not _disk_full(error):
            plain = _plain(error)
            if plain is error:
                raise error
            raise plain from error
        if self.rank == 0:
            self._remove_torn(step)
        previous = self.store.latest()
        kept = f"step {previous} ({self.store.path(previous)}) is intact" if previous is not None else \
            "no earlier checkpoint exists"
        raise CheckpointWriteError(
            self.store.path(step), f"no space left on the device while writing the checkpoint of step {step}; "
            f"it was not committed and {kept}",
            "free space or point checkpoint.dir at a larger volume, or lower checkpoint.keep_last, then resume "
            "the run (`shardline train RUN_DIR`)") from error

    def _remove_torn(self, step: int) -> None:
        try:
            self.store.delete(step)
        except OSError:
            if not self.store.remote:
                shutil.rmtree(self.store.path(step), ignore_errors=True)

    def _commit(self, step: int, started: float, files: dict[str, str]) -> None:
        seconds = time.perf_counter() - started
        if self.rank == 0:
            try:
                for name, text in files.items():
                    self.store.write_text(step, name, text)
                hashes = {name: self.store.hash_file(step, name) for name in [".metadata", *files]}
                self.store.write_text(step, COORDINATOR_CHECKSUMS, checksum_lines(hashes))
                self.store.write_text(step, COMMITTED, json.dumps({"step": step, "time": time.time()}))
            except OSError as e:
                self._write_failed(step, e)
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
    def newest_intact(self, store: CheckpointStore | None = None, steps: list[int] | None = None) -> int | None:
        """The newest committed step whose files all match their recorded checksums (collective: every rank
        checks its share of the files). Damaged steps are skipped; `self.warnings` says which and why."""
        store = store or self.store
        for step in reversed(store.committed() if steps is None else steps):
            mine = store.verify(step, self.rank, self.world)
            flag = torch.tensor([1 if mine else 0], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if not flag.item():
                return step
            found: list[list[str]] = [[] for _ in range(self.world)]
            dist.all_gather_object(found, mine)
            problems = [p for rank_problems in found for p in rank_problems]
            self.warnings.append(f"checkpoint {store.path(step)} is damaged and was skipped: "
                                 + "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5
                                                              else ""))
        return None

    def load(self, step: int, state: dict[str, Any], store: CheckpointStore | None = None,
             ranks_per_row: int = 1) -> dict[str, Any]:
        """Load `state` from a committed step. This rank's RNG entry is filled with the streams of the saved rank
        `rng_source_rank` picks for this run's layout (`ranks_per_row`: tensor × context parallel); streams the
        checkpoint lacks (no such rank, another device type) are dropped. Everything else must be there."""
        store = store or self.store
        reader = store.reader(step)
        present = set(reader.read_metadata().state_dict_metadata)
        mine, source = f"rng_rank{self.rank}", None
        if mine in state:
            streams = state.pop(mine)
            source = self._rng_source(store, step, present, ranks_per_row)
            streams = {} if source is None else _present_only(streams, source, present)
            if streams:
                state[source] = streams
        try:
            dcp.load(state, storage_reader=reader, planner=WeightsOnlyLoadPlanner())
        except CheckpointException as e:
            raise _plain(e) from None
        if source in state:
            state[mine] = state.pop(source)
        return state

    def _rng_source(self, store: CheckpointStore, step: int, present: set[str], ranks_per_row: int) -> str | None:
        """The key of the saved RNG streams this rank restores (None: none). The saved world size is the number of
        ranks that saved streams; the saved ranks per row come from the checkpoint's spec (none: this run's)."""
        saved_world = len({k.split(".", 1)[0] for k in present if k.startswith("rng_rank")})
        saved = checkpoint_spec(store, step)
        saved_per_row = saved.parallel.ranks_per_row if saved is not None else ranks_per_row
        source = rng_source_rank(self.rank, self.world, ranks_per_row, saved_world, saved_per_row)
        return None if source is None else f"rng_rank{source}"


def _present_only(entry: dict[str, Any], prefix: str, present: set[str]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if f"{prefix}.{k}" in present}
