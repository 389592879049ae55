"""Hang detection that names the rank: a heartbeat per rank through the rendezvous store, and a watchdog thread.

NCCL and gloo can only say that a collective timed out, not which rank never arrived. Here every rank runs two
daemon threads beside the training loop (`launch.hang_timeout_seconds`):

- the *publisher* writes this rank's heartbeat (a sequence number, step, phase, wall time, host, pid and the
  main thread's stack top) under `shardline/heartbeat/<rank>` in the rendezvous store every `interval` seconds
  — no new service, and keys are per torchrun attempt (parallel.mesh);
- the *watchdog* checks that this rank's (step, phase) moved within the timeout. When it has not, it dumps
  every thread's Python stack to `logs/stack-rank-<k>.txt` (faulthandler) and the collective flight
  recorder to `logs/flight-recorder-rank-<k>.json`, reads all heartbeats twice an interval apart, and names
  the ranks whose heartbeat stopped arriving (a process SIGSTOPped or frozen, a host gone: both its threads
  stop) or, failing that, the ranks behind the others' step. One rank (the first to claim the report in the
  store) writes the `hang` event to metrics.jsonl, a failure record for each named rank (the launcher's one
  message, the manifest's `failure`) and appends to the manifest's `hangs`; every rank logs the message and
  exits `EXIT_HANG` (76), so torchrun (`launch.max_restarts`) or the engine restarts the group from the last
  committed checkpoint.

The main thread blocked inside a collective releases the GIL, so both threads keep running while it waits;
they only read attributes of the trainer. Phases outside `WATCHED_PHASES` (setup, resume, the final
generation eval) pause the clock: they may legitimately run long without a step.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from shardline.errors import EXIT_HANG
from shardline.failures import HANG_ERROR, WorkerFailure, write_failure
from shardline.jsonl import end_torn_line
from shardline.rundir import manifest_lock, read_manifest, write_manifest

log = logging.getLogger("shardline")

HEARTBEAT_PREFIX = "shardline/heartbeat"
REPORT_KEY = "report-claimed"
WATCHED_PHASES = ("training", "validation", "checkpoint")
IN_COLLECTIVE = "distributed_c10d.py"  # the stack top of a rank blocked in a collective (gloo; NCCL waits elsewhere)
FLIGHT_RECORDER_ENTRIES = "2000"
STORE_DEADLINE_S = 15.0  # a store that does not answer (its host is the hung one) must not hang the watchdog


def heartbeat_interval(timeout_s: float) -> float:
    """Often enough to tell a stopped heartbeat within a tenth of the timeout; rarely enough for 10k ranks."""
    return min(5.0, max(0.5, timeout_s / 10))


def flight_recorder_env(run_dir: Path) -> dict[str, str]:
    """The collective flight recorder (NCCL, and gloo where torch records it): a ring of the last collectives
    per process group, dumped by NCCL's own watchdog on a collective timeout and by ours on a hang."""
    return {"TORCH_FR_BUFFER_SIZE": FLIGHT_RECORDER_ENTRIES,  # TORCH_NCCL_TRACE_BUFFER_SIZE in older torch
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": str(run_dir / "logs" / "nccl-flight-recorder-rank-")}


def enable_flight_recorder(run_dir: Path) -> None:
    """Set the flight recorder's variables before the process group exists (a user's own values win)."""
    for key, value in flight_recorder_env(run_dir).items():
        os.environ.setdefault(key, value)


@dataclass(frozen=True)
class Heartbeat:
    rank: int
    seq: int
    step: int
    phase: str
    time: float
    host: str
    pid: int
    stack_top: str

    def where(self) -> str:
        return f"step {self.step}, {self.phase}, at {self.stack_top}, on {self.host} (pid {self.pid})"


@dataclass(frozen=True)
class HangVerdict:
    """Who the hang is on. `stopped`: heartbeat stopped arriving (or never came); `behind`: alive but at an
    earlier step than the furthest rank; `elsewhere`: at the same step but not inside a collective while the
    others wait in one (stuck in its own code: data, a deadlock); none: every rank waits at the same place."""

    stopped: list[int]
    behind: list[int]
    elsewhere: list[int]
    last: dict[int, Heartbeat]

    @property
    def culprits(self) -> list[int]:
        return self.stopped or self.behind or self.elsewhere


def judge(first: dict[int, Heartbeat], second: dict[int, Heartbeat], world: int) -> HangVerdict:
    """Compare two reads of every heartbeat taken at least two intervals apart."""
    last = {r: second.get(r) or first.get(r) for r in range(world) if second.get(r) or first.get(r)}
    stopped = [r for r in range(world)
               if r not in second or (r in first and second[r].seq == first[r].seq)]
    alive = [r for r in range(world) if r not in stopped]
    furthest = max((last[r].step for r in last), default=0)
    behind = [r for r in alive if last[r].step < furthest]
    waiting = [r for r in alive if IN_COLLECTIVE in last[r].stack_top]
    elsewhere = [r for r in alive if r not in waiting] if waiting and not behind else []
    return HangVerdict(stopped, behind, elsewhere, last)


def hang_message(verdict: HangVerdict, timeout_s: float, now: float) -> str:
    """One paragraph: which rank(s), where, on which host; then the others' position."""
    def line(r: int) -> str:
        hb = verdict.last.get(r)
        if hb is None:
            return f"rank {r} never sent a heartbeat"
        return f"rank {r} — last heartbeat {now - hb.time:.1f}s ago: {hb.where()}"

    kinds = [(verdict.stopped, "stopped arriving (no heartbeat; the process is frozen, stopped or its host is gone)"),
             (verdict.behind, "alive but behind the others' step"),
             (verdict.elsewhere, "alive but outside the collective the others wait in")]
    named, why = next(((ranks, why) for ranks, why in kinds if ranks), ([], ""))
    if named:
        head = (f"hang: rank(s) {', '.join(map(str, named))} {why} — no progress for {timeout_s:g}s "
                "(launch.hang_timeout_seconds)")
    else:
        head = (f"hang: every rank waits at the same place for {timeout_s:g}s (launch.hang_timeout_seconds); no "
                "rank is missing — a collective or the storage is stuck")
    others = [r for r in sorted(verdict.last) if r not in named]
    lines = [head, *(f"  {line(r)}" for r in named)]
    if others:
        lines.append(f"  others: {'; '.join(f'rank {r} at {verdict.last[r].where()}' for r in others[:8])}"
                     + (f" (+{len(others) - 8} more)" if len(others) > 8 else ""))
    return "\n".join(lines)


def stack_top(frame) -> str:
    """The innermost frame, and the innermost one in shardline's own code when that is not it."""
    if frame is None:
        return "?"
    top, own = frame, None
    f = frame
    while f is not None:
        if own is None and f"{os.sep}shardline{os.sep}" in f.f_code.co_filename:
            own = f
        f = f.f_back

    def name(fr) -> str:
        return f"{fr.f_code.co_name} ({Path(fr.f_code.co_filename).name}:{fr.f_lineno})"

    return name(top) if own is None or own is top else f"{name(top)} ← {name(own)}"


class Watchdog:
    """The two threads of one rank. `where()` returns this rank's (step, phase); `on_report(verdict, message)`
    runs on the one rank that claims the report; then the process exits `EXIT_HANG`."""

    def __init__(self, store: dist.Store, rank: int, world: int, timeout_s: float, run_dir: Path,
                 where: Callable[[], tuple[int, str]],
                 on_report: Callable[[HangVerdict, str], None] | None = None) -> None:
        self.store = dist.PrefixStore(HEARTBEAT_PREFIX, store)
        self.rank, self.world, self.timeout_s, self.run_dir = rank, world, timeout_s, run_dir
        self.where, self.on_report = where, on_report
        self.interval = heartbeat_interval(timeout_s)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.main_ident = threading.get_ident()  # the loop's thread (Ray Train runs it outside the main thread)
        self.seq = 0
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self._publish, name="shardline-heartbeat", daemon=True),
                        threading.Thread(target=self._watch, name="shardline-watchdog", daemon=True)]

    def start(self) -> Watchdog:
        self._beat()  # present before any peer could read it
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        """Stop both threads and wait for them: no store call may be in flight when the process group goes."""
        self.stopped.set()
        for t in self.threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join(self.interval + STORE_DEADLINE_S)

    # ---- the publisher -------------------------------------------------------------------------
    def _beat(self) -> None:
        step, phase = self.where()
        self.seq += 1
        frame = sys._current_frames().get(self.main_ident)
        hb = Heartbeat(self.rank, self.seq, step, phase, time.time(), self.host, self.pid, stack_top(frame))
        self.store.set(str(self.rank), json.dumps(asdict(hb)))

    def _publish(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - a store hiccup must not kill the heartbeat for good
                log.warning("heartbeat not published", exc_info=True)

    # ---- the watchdog --------------------------------------------------------------------------
    def _watch(self) -> None:
        last, since = self.where(), time.monotonic()
        while not self.stopped.wait(self.interval):
            now_where, now = self.where(), time.monotonic()
            if now_where != last or now_where[1] not in WATCHED_PHASES:
                last, since = now_where, now
            elif now - since >= self.timeout_s:
                self._fire(now - since)

    def _read_all(self) -> dict[int, Heartbeat]:
        beats = {}
        for r in range(self.world):
            key = str(r)
            if self.store.check([key]):  # get() of a missing key would block the store client
                beats[r] = Heartbeat(**json.loads(self.store.get(key)))
        return beats

    def _with_deadline(self, fn: Callable, seconds: float):
        """`fn()` on a helper thread; None if the store does not answer in time."""
        box: list = []
        t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
        t.start()
        t.join(seconds)
        return box[0] if box else None

    def _fire(self, stalled_s: float) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        stack_file = logs / f"stack-rank-{self.rank}.txt"
        step, phase = self.where()
        with stack_file.open("w") as f:
            f.write(f"rank {self.rank} on {self.host} (pid {self.pid}): no progress for {stalled_s:.1f}s at "
                    f"step {step}, {phase}; all Python threads, most recent call first:\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        recorder = dump_flight_recorder(logs / f"flight-recorder-rank-{self.rank}.json")
        claimed = self._with_deadline(lambda: self.store.add(REPORT_KEY, 1), STORE_DEADLINE_S)
        if claimed is None:
            message = (f"hang: no progress for {stalled_s:.0f}s and the rendezvous store does not answer (its "
                       "host is frozen or gone); stacks in logs/stack-rank-*.txt")
        else:
            first = self._with_deadline(self._read_all, STORE_DEADLINE_S)
            time.sleep(2 * self.interval + 0.2)
            second = self._with_deadline(self._read_all, STORE_DEADLINE_S)
            verdict = judge(first or {}, second or {}, self.world)
            message = hang_message(verdict, self.timeout_s, time.time())
            if first is None or second is None:
                message += "\n  (the rendezvous store stopped answering while the heartbeats were read)"
            message += f"\n  stacks: {logs}/stack-rank-*.txt" + (f"; flight recorder: {recorder}" if recorder else "")
            if claimed == 1 and self.on_report is not None:
                try:
                    self.on_report(verdict, message)
                except Exception:  # noqa: BLE001 - the exit below is what restarts the run
                    log.exception("hang report incomplete")
            if killed := kill_frozen_local_peers(verdict, self.host):
                message += f"\n  killed the frozen worker(s) on this host (pid {', '.join(map(str, killed))}): " \
                           "torchrun would wait 30 s for them before restarting"
        log.error(message)
        for handler in log.handlers:
            handler.flush()
        if claimed == 1 or claimed is None:
            print(f"error: rank {self.rank}: {message}", file=sys.stderr, flush=True)
        os._exit(EXIT_HANG)


def kill_frozen_local_peers(verdict: HangVerdict, host: str) -> list[int]:
    """SIGKILL the stopped ranks' processes on this host (a frozen process ignores torchrun's SIGTERM, and the
    agent waits 30 s before its SIGKILL); only workers of this run (the same `--spec` on their command line)."""
    killed = []
    try:
        own = Path("/proc/self/cmdline").read_bytes().split(b"\0")
        run_spec = own[own.index(b"--spec") + 1]
    except (OSError, ValueError, IndexError):
        return killed  # not started as a worker: nothing here can tell which processes are this run's
    for r in verdict.stopped:
        hb = verdict.last.get(r)
        if hb is None or hb.host != host or hb.pid == os.getpid():
            continue
        try:
            theirs = Path(f"/proc/{hb.pid}/cmdline").read_bytes().split(b"\0")
            if b"shardline.worker" in theirs and run_spec in theirs:
                os.kill(hb.pid, signal.SIGKILL)
                killed.append(hb.pid)
        except OSError:  # gone already, or not ours to kill
            continue
    return killed


def dump_flight_recorder(path: Path) -> Path | None:
    """The process's collective flight recorder as JSON (torch ≥ 2.5 records NCCL; 2.13 also gloo), if any."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        data = _dump_fr_trace_json(True, False)
    except Exception:  # noqa: BLE001 - not built in, or nothing recorded: the stacks still tell
        return None
    if not data:
        return None
    path.write_bytes(data if isinstance(data, bytes) else str(data).encode())
    return path


@contextmanager
def hang_watchdog(trainer, run_dir: Path) -> Iterator[Watchdog | None]:
    """Watch `trainer` (its `step`, `phase`, metrics writer and checkpoint store) while the block runs;
    does nothing when `launch.hang_timeout_seconds` is unset or 0, or without a process group."""
    spec = trainer.spec
    timeout = spec.launch.hang_timeout_seconds
    if not timeout or not dist.is_initialized():
        yield None
        return

    def report(verdict: HangVerdict, message: str) -> None:
        _report(trainer, run_dir, verdict, message)

    dog = Watchdog(dist.distributed_c10d._get_default_store(), trainer.ctx.rank, trainer.ctx.world, timeout,
                   run_dir, lambda: (trainer.step, trainer.phase), report).start()
    try:
        yield dog
    finally:
        dog.stop()


def _report(trainer, run_dir: Path, verdict: HangVerdict, message: str) -> None:
    """The one report of a hang: metrics event, failure records of the named ranks, the manifest's `hangs`."""
    now = time.time()
    named = verdict.culprits or [trainer.ctx.rank]
    event = {"event": "hang", "ranks": named, "stopped": verdict.stopped, "behind": verdict.behind,
             "reported_by": trainer.ctx.rank, "timeout_s": trainer.spec.launch.hang_timeout_seconds,
             "where": {str(r): asdict(hb) for r, hb in verdict.last.items() if r in named},
             "stack_files": sorted(str(p) for p in (run_dir / "logs").glob("stack-rank-*.txt")),
             "message": message}
    if trainer.metrics is not None:
        trainer.metrics.write("event", event)
    else:
        end_torn_line(run_dir / "metrics.jsonl")
        with (run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"kind": "event", "time": round(now, 3), **event}) + "\n")
    try:
        committed = trainer.checkpointer.store.latest()
        location = trainer.checkpointer.store.path(committed) if committed is not None else None
    except Exception:  # noqa: BLE001 - an unreachable store must not stop the report
        committed = location = None
    for r in named:
        hb = verdict.last.get(r)
        write_failure(run_dir, WorkerFailure(
            rank=r, host=hb.host if hb else "?", error_type=HANG_ERROR,
            message=message.splitlines()[0] + (f"; last seen at {hb.where()}" if hb else ""),
            phase=hb.phase if hb and hb.phase in ("training", "validation", "checkpoint") else "training",
            step=hb.step if hb else trainer.step, max_steps=trainer.spec.train.max_steps,
            committed_step=committed, checkpoint=location, log=str(_log_of(run_dir, r)),
            time=now))
    if (run_dir / "manifest.json").exists():
        hosts = sorted({verdict.last[r].host for r in named if r in verdict.last})
        hang = {"time": now, "ranks": named, "hosts": hosts,
                "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "committed_step": committed}
        with manifest_lock(run_dir):
            manifest = read_manifest(run_dir)
            write_manifest(run_dir, manifest | {"hangs": [*manifest.get("hangs", []), hang]})


def _log_of(run_dir: Path, rank: int) -> Path:
    """The named rank's stack dump when it wrote one (it was not frozen), else its log."""
    stack = run_dir / "logs" / f"stack-rank-{rank}.txt"
    return stack if stack.exists() else run_dir / "logs" / f"rank-{rank}.log"
