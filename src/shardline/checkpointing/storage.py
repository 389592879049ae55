"""DCP storage that records checksums when it writes and runs no code when it reads.

Writing: each rank hashes the shard files it wrote (SHA-256) into `__<rank>_.sha256` in the step directory
before it reports its write done, so once the coordinator writes `.metadata` every rank's list exists.
The files use `sha256sum` format: `cd step-XXXXXXXX && sha256sum -c *.sha256` checks a checkpoint by hand.

Reading: DCP unpickles `.metadata` and `torch.load`s non-tensor entries with `weights_only=False`; a
checkpoint in a writable bucket would then be code execution. The reader here unpickles `.metadata` with
an allowlist of DCP's own metadata types, and the load planner reads non-tensor entries `weights_only`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from shardline.errors import ShardlineError

CHECKSUM_SUFFIX = ".sha256"
_HASH_CHUNK = 8 << 20
FULL_BELOW_BYTES = 1 << 20  # a local filesystem with less room than this after a failed write is full

def _metadata_globals() -> dict[tuple[str, str], Any]:
    """Every global a DCP `.metadata` pickle may name, as exact `(module, name)` pairs mapped to the object itself:
    DCP's own metadata dataclasses and the torch/pathlib values inside them. No dotted names, no module-wide
    entries: pickle protocol 4 resolves `("allowed.module", "os.system")` through attributes, so the unpickler
    returns these objects from the table and never imports or looks anything up."""
    import collections
    import pathlib

    import torch.distributed.checkpoint.filesystem as dcp_filesystem
    import torch.distributed.checkpoint.metadata as dcp_metadata
    import torch.serialization

    names = {
        dcp_metadata: ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                       "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"),
        dcp_filesystem: ("_StorageInfo",),
        torch.serialization: ("_get_layout",),
        torch: ("Size",),
        pathlib: ("PosixPath", "PurePosixPath"),
        collections: ("OrderedDict",),
    }
    table = {(module.__name__, name): getattr(module, name) for module, attrs in names.items() for name in attrs}
    table.update({("torch", name): value for name, value in vars(torch).items()
                  if isinstance(value, torch.dtype | torch.layout | torch.memory_format)})
    return table


_METADATA_GLOBALS = _metadata_globals()
_METADATA_ERRORS = (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, KeyError, IndexError,
                    RecursionError, MemoryError, UnicodeDecodeError)
"""What a damaged or hostile pickle can raise on the way to a refusal (a constructor called with wrong arguments,
a layout name that is not one, a truncated stream, a deeply nested one)."""


def sha256_stream(stream: Any) -> str:
    digest = hashlib.sha256()
    while chunk := stream.read(_HASH_CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def checksum_lines(hashes: dict[str, str]) -> str:
    return "".join(f"{h}  {name}\n" for name, h in sorted(hashes.items()))


def parse_checksums(text: str, source: str) -> dict[str, str]:
    hashes = {}
    for line in text.splitlines():
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64:
            raise ShardlineError(source, f"is not a sha256sum list (line {line[:80]!r})",
                                 "the checkpoint's checksum list is damaged: resume from an earlier checkpoint")
        hashes[name] = digest
    return hashes


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _METADATA_GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"{module}.{name} is not a checkpoint metadata type") from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not checkpoint metadata")


def _global_attributes() -> dict[tuple[str, str], dict[str, Any]]:
    return {key: dict(vars(value)) for key, value in _METADATA_GLOBALS.items() if hasattr(value, "__dict__")}


def _restore_global_attributes(before: dict[tuple[str, str], dict[str, Any]]) -> bool:
    """Put back any attribute a pickle changed on an allowlisted class or function; whether there was one."""
    changed = False
    for key, attributes in before.items():
        target = _METADATA_GLOBALS[key]
        now = vars(target)
        for name in set(now) - set(attributes):
            delattr(target, name)
            changed = True
        for name, value in attributes.items():
            if name not in now or now[name] is not value:
                setattr(target, name, value)
                changed = True
    return changed


def load_metadata(stream: Any, source: str) -> Metadata:
    """A DCP `.metadata` index unpickled through the allowlist, checked to be one: anything else is a named error
    saying which file and why (never a traceback, never code run)."""
    before = _global_attributes()
    try:
        metadata = _MetadataUnpickler(stream).load()
    except _METADATA_ERRORS as e:
        problem = f"is not a DCP checkpoint index ({type(e).__name__}: {str(e)[:200]})"
    else:
        problem = f"is not a DCP checkpoint index (it holds a {type(metadata).__name__})"
        if isinstance(metadata, Metadata) and isinstance(metadata.state_dict_metadata, dict):
            problem = ""
    if _restore_global_attributes(before):  # BUILD on a class object sets class attributes: undone, refused
        problem = "is not a DCP checkpoint index (it rewrites attributes of the types it names)"
    if not problem:
        return metadata
    raise ShardlineError(source, problem, "the checkpoint was damaged or replaced: resume from another checkpoint "
                         "(checkpoint.resume_from) and check who can write to the bucket")


class _SafeMetadata:
    """`read_metadata` through the allowlist unpickler (mixed into DCP's readers)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_SafeMetadata, FileSystemReader):
    pass


class SafeFsspecReader(_SafeMetadata, FsspecReader):
    pass


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """Non-tensor entries (counters, optimizer hyper-parameters) load with `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise ShardlineError(read_item.dest_index.fqn, f"in the checkpoint holds a non-data object ({e})",
                                 "checkpoints hold tensors and plain values only; this one was written by "
                                 "something else: resume from another checkpoint") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class _Checksummed:
    """`write_data` that hashes this rank's files once they are written (mixed into DCP's writers).

    `after_write` runs between the two (fault drills stop a rank there)."""

    def __init__(self, *args: Any, after_write: Callable[[], None] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.after_write = after_write

    def write_data(self, plan, planner):
        try:
            future = super().write_data(plan, planner)
            results = future.wait()
        except Exception as e:
            # A full disk does not always say ENOSPC (torch's zip writer reports a short write as
            # "unexpected pos"). Ask the filesystem now, before any rank hears of the failure and
            # frees the torn step, so every rank classifies the failure alike.
            if out_of_space(str(self.path)):
                raise OSError(errno.ENOSPC, f"No space left on device under {self.path} ({e})") from e
            raise
        if self.after_write is not None:
            self.after_write()
        hashes = {}
        for name in sorted({r.storage_data.relative_path for r in results}):
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as f:
                hashes[name] = sha256_stream(f)
        listing = self.fs.concat_path(self.path, f"{plan.storage_data.prefix}{CHECKSUM_SUFFIX}")
        with self.fs.create_stream(listing, "wb") as f:
            f.write(checksum_lines(hashes).encode())
            if self.sync_files:
                with contextlib.suppress(AttributeError, io.UnsupportedOperation):
                    os.fsync(f.fileno())
        return future


def out_of_space(path: str) -> bool:
    """True when the local filesystem holding `path` has (almost) no room left; False for URLs."""
    try:
        stat = os.statvfs(path)
    except (OSError, ValueError):
        return False
    blocks = stat.f_bfree if os.geteuid() == 0 else stat.f_bavail  # root may write into reserved blocks
    return blocks * stat.f_frsize < FULL_BELOW_BYTES


class ChecksummedFileSystemWriter(_Checksummed, FileSystemWriter):
    pass


class ChecksummedFsspecWriter(_Checksummed, FsspecWriter):
    pass
