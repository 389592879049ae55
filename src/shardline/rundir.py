"""The run directory (docs/architecture.md §4): `runs/<run_id>/` with spec.yaml, manifest.json, metrics, logs."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import platform
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from importlib.metadata import version as distribution_version
from pathlib import Path
from typing import NoReturn

from shardline.clock import format_duration
from shardline.errors import ShardlineError, SpecError
from shardline.precision import PrecisionChoice, choose_precision, cuda_native_bf16
from shardline.spec import JobSpec
from shardline.spec.resolve import read_spec_file, spec_hash, spec_to_yaml
from shardline.spec.resume_policy import changed_fields, check_resume
from shardline.version import __version__

ATTEMPTS_DIR = "attempts"
LIVE: tuple[str, ...] = ("starting", "running")
"""Manifest statuses of a run that has not ended."""
HEARTBEAT_FILE = ".launcher.heartbeat"
HEARTBEAT_EVERY_S = 15.0
"""How often the launcher that claimed a run rewrites its heartbeat (host, pid, time)."""
HEARTBEAT_STALE_S = 120.0
"""A live run on another host whose run directory saw no write (heartbeat, manifest, metrics) for this long is
presumed dead: longer than a few missed beats and an NFS client's attribute cache (60 s by default)."""


class RunAliveElsewhere(SpecError):
    """The run's launcher lives on another host that shares the run directory: its heartbeat is fresh."""


def run_path(spec: JobSpec) -> Path:
    if spec.run.id is None:
        raise SpecError("run.id", "not assigned", "create the run with `shardline train`")
    return Path(spec.run.dir) / spec.run.id


def checkpoint_location(spec: JobSpec, run_dir: Path) -> str:
    """Where a run's checkpoints live: its own prefix `checkpoint.dir/<run.id>`, or `<run dir>/checkpoints`."""
    if spec.checkpoint.dir:
        if spec.run.id is None:
            raise SpecError("run.id", "not assigned, but checkpoint.dir needs it for the run's own prefix",
                            "create the run with `shardline train` (or set run.id)")
        return f"{spec.checkpoint.dir.rstrip('/')}/{spec.run.id}"
    return str(Path(run_dir) / "checkpoints")


def new_run_id(name: str) -> str:
    """`<name>-<UTC time>-<4 random hex>`: two launches in the same second still get different runs."""
    return f"{name}-{datetime.now(UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def with_run_id(spec: JobSpec, claim: bool = False) -> JobSpec:
    """The spec with a fresh run id when it has none (an explicit run.id is a resume and is kept), never one
    whose directory exists here. With `claim`, the directory is created atomically (`mkdir` without
    `exist_ok`), so two launches that drew the same id in the same second never share a run directory."""
    if spec.run.id is not None:
        return spec
    spec = spec.model_copy(deep=True)
    if claim:
        Path(spec.run.dir).mkdir(parents=True, exist_ok=True)
    while True:
        spec.run.id = new_run_id(spec.run.name)
        if not claim:
            if not run_path(spec).exists():
                return spec
            continue
        try:
            run_path(spec).mkdir()
            return spec
        except FileExistsError:
            continue


def create_run(spec: JobSpec, started_at: float | None = None) -> tuple[JobSpec, Path]:
    """Assign a run id (unless the spec names an existing run) and write spec.yaml + manifest.json.

    `started_at` (epoch seconds) is when this launch began, if earlier than now: the CLI passes its own process
    start, so goodput's clock includes the command's startup (imports, spec validation) before this call.

    Every launch of the run is an attempt: its spec is kept as `attempts/NNN-spec.yaml` and listed in the
    manifest with the fields it changed; `spec.yaml` is the current attempt's.

    A new run's directory is created atomically (`mkdir` without `exist_ok`), so it never shares a directory
    with another launch, even one that drew the same id."""
    ckpt = spec.checkpoint.dir
    if ckpt and "://" not in ckpt and not Path(ckpt).is_absolute():  # resolved here, where it was meant: a later
        spec = spec.model_copy(deep=True)                             # `train RUN_DIR` from elsewhere finds it
        spec.checkpoint.dir = str(Path(ckpt).resolve())
    spec = with_run_id(spec, claim=True)
    spec, precision = _choose_precision(spec)
    path = run_path(spec)
    spec_file = path / "spec.yaml"
    changed: list[str] = []
    if spec_file.exists():
        previous = read_spec(spec_file)
        check_resume(previous, spec)
        changed = list(changed_fields(previous, spec))
    path.mkdir(parents=True, exist_ok=True)
    (path / "logs").mkdir(exist_ok=True)
    with manifest_lock(path):  # a launcher settling the previous attempt reads and writes under the same lock
        return _new_attempt(spec, path, changed, precision, started_at)


def _new_attempt(spec: JobSpec, path: Path, changed: list[str], precision: PrecisionChoice | None,
                 started_at: float | None) -> tuple[JobSpec, Path]:
    """Append this launch to the manifest's attempts and reset it to `starting` (under the manifest lock)."""
    spec_file = path / "spec.yaml"
    manifest = read_manifest(path)
    attempts = manifest.get("attempts", [])
    attempt_file = f"{ATTEMPTS_DIR}/{len(attempts) + 1:03d}-spec.yaml"
    (path / ATTEMPTS_DIR).mkdir(exist_ok=True)
    (path / attempt_file).write_text(spec_to_yaml(spec))
    now = _now(started_at)  # one reading: a new run's start is its first launch's, to the second
    attempts.append({"attempt": len(attempts) + 1, "start_time": now, "spec_file": attempt_file,
                     "spec_hash": spec_hash(spec), "changed": changed})
    spec_file.write_text(spec_to_yaml(spec))
    manifest.update({
        "attempts": attempts,
        "run_id": spec.run.id, "start_time": manifest.get("start_time", now), "spec_hash": spec_hash(spec),
        "git_commit": _git_commit(), "shardline_version": __version__, "versions": _versions(),
        "world_size": spec.world_size, "host": socket.gethostname(), "status": "starting", "exit_code": None,
        "failure": None, "end_time": None, "processes": [],
        "image": os.environ.get("SHARDLINE_IMAGE"), "image_digest": os.environ.get("SHARDLINE_IMAGE_DIGEST"),
        "spec": spec.model_dump(mode="json"),
        "checkpoint_location": checkpoint_location(spec, path),
    })
    if precision is not None:
        manifest["precision"] = {"chosen": precision.precision, "reason": precision.reason}
    write_manifest(path, manifest)
    return spec, path


def _choose_precision(spec: JobSpec) -> tuple[JobSpec, PrecisionChoice | None]:
    """`train.precision: auto` made concrete for the hardware this run is created on (a local launch, or rank
    0 of a cluster job): spec.yaml keeps the choice, so a resume on other hardware keeps the precision."""
    if spec.train.precision != "auto":
        return spec, None
    import torch

    choice = choose_precision("auto", accelerator=torch.cuda.is_available(), native_bf16=cuda_native_bf16())
    spec = spec.model_copy(deep=True)
    spec.train.precision = choice.precision
    return spec, choice


def read_spec(path: Path) -> JobSpec:
    return read_spec_file(str(path), path.read_text())


def read_manifest(run_dir: Path) -> dict:
    f = run_dir / "manifest.json"
    return json.loads(f.read_text()) if f.exists() else {}


def write_manifest(run_dir: Path, manifest: dict) -> None:
    """Replace manifest.json atomically. The temporary file is unique to this writer (host, pid and a random
    suffix): in pods and on Vertex every node's wrapper is pid 1, and nodes sharing a lockless (FUSE) mount
    must not write, rename or lose each other's file."""
    tmp = run_dir / f"manifest.json.tmp-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        tmp.write_text(json.dumps(manifest, indent=2, default=str))
        os.replace(tmp, run_dir / "manifest.json")
    finally:
        tmp.unlink(missing_ok=True)


def write_run_file(run_dir: Path, relative: str, data: str | bytes) -> Path:
    """Create or replace `run_dir/relative` without following a link planted in the run directory (it lives on
    shared storage, where anyone may leave `report/loss.png -> someone else's file`): every folder below `run_dir`
    is opened without following links (created when missing), the bytes go to a new temporary name created
    exclusively there (O_CREAT|O_EXCL|O_NOFOLLOW), are fsynced and renamed onto the final name, which replaces a
    link rather than writing through it. A folder that is a link is a ShardlineError naming it. `run_dir` itself
    is the caller's path and is followed."""
    payload = data.encode() if isinstance(data, str) else data
    fd, name = _open_folders(run_dir, relative)
    try:
        tmp = f".{name}.tmp-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=fd)
        try:
            with os.fdopen(out, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp, dir_fd=fd)
            raise
    finally:
        os.close(fd)
    return run_dir / relative


def remove_run_file(run_dir: Path, relative: str) -> None:
    """Remove `run_dir/relative` if it is there (a link is removed, never what it points to); the folders below
    `run_dir` are opened as `write_run_file` opens them."""
    fd, name = _open_folders(run_dir, relative)
    try:
        with suppress(FileNotFoundError):
            os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)


def _open_folders(run_dir: Path, relative: str) -> tuple[int, str]:
    """The open folder that holds `run_dir/relative` (its folders below `run_dir` created when missing, each opened
    without following a link) and the file's name in it."""
    *folders, name = Path(relative).parts
    if not name or ".." in folders or name == ".." or Path(relative).is_absolute():
        raise ValueError(f"not a plain path inside the run directory: {relative!r}")
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, folder in enumerate(folders):
            with suppress(FileExistsError):
                os.mkdir(folder, dir_fd=fd)
            try:
                inner = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as e:  # ELOOP: a link (O_NOFOLLOW); ENOTDIR: a file, or a link (with O_DIRECTORY)
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                _refuse_folder(fd, folder, run_dir.joinpath(*folders[: i + 1]))
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd, name


def _refuse_folder(parent: int, name: str, path: Path) -> NoReturn:
    """A ShardlineError for a run directory's folder that is a link or not a folder."""
    try:
        what = f"a symbolic link to {os.readlink(name, dir_fd=parent)}"
    except OSError:
        what = "not a folder"
    raise ShardlineError(str(path), f"is {what}: shardline writes a run's files only into the run's own folders, "
                         "never through a link (run directories are shared storage)",
                         f"remove it (`rm {path}`) and run the command again")


@contextmanager
def manifest_lock(run_dir: Path) -> Iterator[None]:
    """Serialise read-modify-write of the manifest between the processes of one host (launcher, torchrun,
    rank 0); where the filesystem has no locks (some FUSE mounts), writes stay atomic but unserialised."""
    try:
        handle = (run_dir / ".manifest.lock").open("a")
    except OSError:
        yield
        return
    with handle:
        with suppress(OSError):
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def update_manifest(run_dir: Path, **fields) -> None:
    with manifest_lock(run_dir):
        write_manifest(run_dir, read_manifest(run_dir) | fields)


def update_attempt(run_dir: Path, **fields) -> None:
    """Add fields to the current (last) launch attempt of the manifest."""
    with manifest_lock(run_dir):
        manifest = read_manifest(run_dir)
        attempts = manifest.get("attempts") or [{}]
        attempts[-1] = attempts[-1] | fields
        write_manifest(run_dir, manifest | {"attempts": attempts})


def _now(at: float | None = None) -> str:
    """ISO-8601 UTC to the millisecond (goodput's clock reads it): now, or the epoch time `at`."""
    moment = datetime.now(UTC) if at is None else datetime.fromtimestamp(at, UTC)
    return moment.isoformat(timespec="milliseconds")


def _git_commit() -> str | None:
    """The source commit: the image's build argument (SHARDLINE_GIT_COMMIT; an image holds no .git), else git's."""
    if commit := os.environ.get("SHARDLINE_GIT_COMMIT"):
        return commit
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _versions() -> dict[str, str]:
    """From the installed distributions: importing torch, transformers and peft just for their versions costs
    seconds (torch's distribution version is its `__version__`, the local build tag included)."""
    return {"python": platform.python_version(), "torch": distribution_version("torch"),
            "transformers": distribution_version("transformers"), "peft": distribution_version("peft"),
            "shardline": __version__, "platform": platform.platform()}


_CLAIMS: dict[Path, object] = {}
"""Open claim files of this process by run directory: their locks hold until it exits (the kernel drops them on
any death; a lock is per open file, so a second claim of one run by this process must not reopen it)."""


def claim_run(run_dir: Path) -> None:
    """Make this process the run's only launcher, atomically on this host: an exclusive lock on
    `run_dir/.launcher.lock`, held for the process's life. A second launcher here (`shardline train RUN` twice
    within a second) gets a SpecError; where the filesystem has no locks, the live-process check alone guards
    the run. Other hosts sharing the run directory cannot see this process: it keeps a heartbeat there
    (`HEARTBEAT_FILE`, rewritten every `HEARTBEAT_EVERY_S`) for its life, and a run still heard from on another
    host is refused with `RunAliveElsewhere`."""
    if run_dir.resolve() in _CLAIMS:
        return
    handle = (run_dir / ".launcher.lock").open("a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise SpecError(str(run_dir), "is being launched by another shardline process on this host",
                        f"wait for it (`shardline wait {run_dir}`) or stop it (`shardline cancel {run_dir}`), then "
                        "train it again to resume") from None
    except OSError:  # no locks on this filesystem
        handle.close()
        handle = None
    try:
        refuse_if_alive_elsewhere(run_dir)  # before this launcher's first beat replaces the other host's
    except SpecError:
        if handle is not None:
            handle.close()
        raise
    _CLAIMS[run_dir.resolve()] = handle
    write_heartbeat(run_dir)
    threading.Thread(target=_keep_beating, args=(run_dir,), name=f"heartbeat {run_dir.name}", daemon=True).start()


def write_heartbeat(run_dir: Path) -> None:
    """This process's beat: host, pid and time, replaced atomically (a reader never sees half a file)."""
    tmp = run_dir / f"{HEARTBEAT_FILE}.tmp-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        tmp.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}))
        os.replace(tmp, run_dir / HEARTBEAT_FILE)
    finally:
        tmp.unlink(missing_ok=True)


def _keep_beating(run_dir: Path) -> None:
    while True:
        time.sleep(HEARTBEAT_EVERY_S)
        try:
            write_heartbeat(run_dir)
        except OSError:  # the run directory is gone (or unwritable): nobody is left to tell
            return


def _opened_mtime(path: Path) -> float | None:
    try:
        with path.open("rb") as f:  # opened, not only stat'ed: an NFS client revalidates what it cached on open
            return os.fstat(f.fileno()).st_mtime
    except OSError:
        return None


def last_heard(run_dir: Path, manifest: dict) -> tuple[str | None, float | None]:
    """(host, epoch time) of the run's last sign of life in its directory: the host of the launcher's heartbeat,
    unless the manifest was written after it (a new attempt created elsewhere, its launcher not yet beating),
    and the newest write of the heartbeat, manifest.json or metrics.jsonl (rank 0 writes it every step, so a
    cluster run without a launcher heartbeat is heard from too). Times are the files' modification times, which
    every host sharing the directory reads alike."""
    beat, written = _opened_mtime(run_dir / HEARTBEAT_FILE), _opened_mtime(run_dir / "manifest.json")
    host = manifest.get("host")
    if beat is not None and (written is None or beat >= written):
        with suppress(OSError, ValueError, AttributeError):
            host = json.loads((run_dir / HEARTBEAT_FILE).read_text()).get("host") or host
    times = [t for t in (beat, written, _opened_mtime(run_dir / "metrics.jsonl")) if t is not None]
    return host, max(times, default=None)


def elsewhere(run_dir: Path, manifest: dict) -> tuple[str, float] | None:
    """(host, seconds since it was last heard from) for a live run whose launcher is on another host — where
    this host's process table says nothing about it; None for a run that ended, or runs here."""
    if manifest.get("status") not in LIVE:
        return None
    host, heard = last_heard(run_dir, manifest)
    if host is None or host == socket.gethostname() or heard is None:
        return None
    return host, max(0.0, time.time() - heard)


def refuse_if_alive_elsewhere(run_dir: Path) -> None:
    """Refuse to launch a run again while it is heard from on another host (within `HEARTBEAT_STALE_S`)."""
    found = elsewhere(run_dir, read_manifest(run_dir))
    if found is None or found[1] > HEARTBEAT_STALE_S:
        return
    host, silent = found
    raise RunAliveElsewhere(
        str(run_dir), f"is alive on {host} (last heartbeat {format_duration(silent)} ago)",
        f"wait for it or stop it on {host} (`shardline wait {run_dir}`, `shardline cancel {run_dir}`), then train it "
        f"again to resume; if {host} is really down, train it again once the run directory has had no heartbeat "
        f"for {format_duration(HEARTBEAT_STALE_S)} (in {format_duration(HEARTBEAT_STALE_S - silent)})")
