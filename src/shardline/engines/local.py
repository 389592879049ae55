"""Local launcher: the one worker command under `torchrun --standalone` on this machine.

`shardline train` runs it in the foreground (`train_run`); `shardline launch --target local` (and the Python
API) start the same launcher detached (`python -m shardline.engines.local RUN_DIR`), and `LocalBackend` gives
local runs the verbs every engine has: status, logs, wait, cancel.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from shardline.data import PREPARED_DATA_ENV
from shardline.engines.backend import JobState, LaunchRecord, RankState, save_record
from shardline.engines.command import torchrun_policy_flags, worker_command
from shardline.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PREEMPTED,
    ShardlineError,
    SpecError,
)
from shardline.run_status import (
    LIVE,
    RECORD_PROCESSES_ENV,
    live_processes,
    mark_failed,
    read_status,
    record_process,
    refuse_if_running,
    settle,
)
from shardline.rundir import claim_run, create_run, read_manifest, read_spec, run_path, update_attempt
from shardline.spec import JobSpec
from shardline.spec.resolve import spec_to_yaml
from shardline.spec.rules import require_torch_engine

if TYPE_CHECKING:
    from shardline.data.prepare import PreparedData

LAUNCHER_LOG = "launcher.log"
"""A detached launcher's console (step lines, the failure message), in the run's logs/."""


def torchrun_command(spec: JobSpec, spec_path: Path, task: str = "train") -> list[str]:
    require_torch_engine(spec, "--target local")
    if spec.launch.nnodes != 1:
        raise SpecError("launch.nnodes", f"{spec.launch.nnodes} nodes cannot run on this machine alone",
                        "use 1 for local runs, or a cluster launcher for multi-node jobs")
    return [sys.executable, "-m", "shardline.engines.torchrun", "--standalone",
            f"--nproc-per-node={spec.parallel.nproc_per_node}", *torchrun_policy_flags(spec),
            *worker_command(spec_path, task)]


def run_local(spec: JobSpec, spec_path: Path, task: str = "train", run_dir: Path | None = None,
              prepared: Path | None = None) -> int:
    """Run the worker group to completion and return the exit code (docs/architecture.md §7).

    SIGTERM/SIGUSR1 sent to this process are passed to torchrun, which forwards them to the workers
    and gives them `launch.grace_seconds` to checkpoint; a run that stopped that way exits 75. With `run_dir`,
    torchrun's pid goes into the manifest, so a later command can tell whether the run still lives. `prepared`: the
    data directory this launcher prepared for the spec, which the workers open instead of preparing again.
    """
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if run_dir is not None:
        env[RECORD_PROCESSES_ENV] = "1"
    env.pop(PREPARED_DATA_ENV, None)  # one inherited from an enclosing run names that run's data, not this spec's
    if prepared is not None:
        env[PREPARED_DATA_ENV] = str(prepared.resolve())
    proc: subprocess.Popen | None = None
    pending: list[int] = []

    def forward(signum, frame):
        if proc is None:
            pending.append(signum)  # arrived while torchrun was being started: delivered once it runs
        else:
            proc.send_signal(signum)

    def interrupted(signum, frame):
        pass  # Ctrl-C signals the whole process group: torchrun and the workers have it already (forwarding it
        # again would cut torchrun's grace period short); the workers checkpoint and the run exits 75

    # installed before torchrun starts: a SIGTERM in between must reach it, not kill this process and orphan it
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupted)
    try:
        proc = subprocess.Popen(torchrun_command(spec, spec_path, task), env=env)
        if run_dir is not None:
            record_process(run_dir, proc.pid, "torchrun")
        for signum in pending:
            proc.send_signal(signum)
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code != EXIT_OK and read_manifest(spec_path.parent).get("status") == "preempted":
        return EXIT_PREEMPTED
    return code


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def train_run(spec: JobSpec, run_dir: Path, prepare: Callable[[JobSpec], PreparedData],
              say: Callable[[str], None]) -> int:
    """Prepare the data, run the workers, and leave the manifest with the true final status whatever happened:
    the workers' own (finished, preempted, failed with their records), or the launcher's (bad input found
    here, an interrupt, workers that died without a word); then the report. Returns the exit code."""
    attempt = len(read_manifest(run_dir).get("attempts") or [])  # this launch's: settled only while it is the last
    record_process(run_dir, os.getpid(), "launcher")
    save_record(run_dir, LaunchRecord(target="local", run_id=run_dir.name, submitted_at=_now(),
                                      job_id=str(os.getpid()), run_dir=str(run_dir.resolve())))
    def cancelled(signum, frame):
        raise KeyboardInterrupt(f"cancelled ({signal.Signals(signum).name}) before the workers started")

    previous = signal.signal(signal.SIGTERM, cancelled)  # run_local forwards it to the workers once they run
    try:
        started = time.perf_counter()
        data = prepare(spec)
        update_attempt(run_dir, prepare_s=round(time.perf_counter() - started, 3))  # a goodput bucket
        code = run_local(spec, run_dir / "spec.yaml", "train", run_dir=run_dir, prepared=data.root)
    except ShardlineError as e:
        mark_failed(run_dir, str(e), EXIT_BAD_INPUT, type(e).__name__, "setup")
        raise
    except KeyboardInterrupt as e:
        mark_failed(run_dir, str(e) or "interrupted (Ctrl-C) before the workers recorded an outcome",
                    EXIT_INTERRUPTED, "KeyboardInterrupt")
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    if code != EXIT_OK:
        settle(run_dir, exit_code=code, attempt=attempt)
    if spec.observe.report:  # rank 0 wrote it unless the workers died first; never changes the exit code
        from shardline.observe.report import report_is_current, write_report_safely

        if not report_is_current(run_dir):
            write_report_safely(run_dir, say)
    return code


def _follow_files(paths: Callable[[], list[tuple[str, Path]]], follow: bool, ended: Callable[[], bool],
                  poll_s: float = 0.5) -> Iterator[str]:
    """Lines of every (prefix, file), then, with follow, new lines as they are written until `ended()`."""
    offsets: dict[Path, int] = {}
    while True:
        done = ended() if follow else True  # read after deciding, so the last lines are never missed
        for prefix, path in paths():
            try:
                with path.open("rb") as f:
                    f.seek(offsets.get(path, 0))
                    data = f.read()
            except OSError:
                continue
            complete = data[:data.rfind(b"\n") + 1] if not done else data
            offsets[path] = offsets.get(path, 0) + len(complete)
            for line in complete.decode(errors="replace").splitlines():
                yield line if line.startswith(prefix) or f"{prefix.strip()}" in line[:60] else f"{prefix}{line}"
        if done:
            return
        time.sleep(poll_s)


class LocalBackend:
    """Runs on this machine, as first-class as a cluster job: status from the run directory (a run whose
    processes are gone is settled, never "running"), logs from its files, cancel by SIGTERM to the launcher
    (the workers checkpoint and the run ends `preempted`, exit 75)."""

    target = "local"

    def render(self, spec: JobSpec, task: str = "train") -> dict[str, str]:
        spec_path = Path(spec.run.dir) / (spec.run.id or "<run id>") / "spec.yaml"
        return {"run-local.sh": "#!/bin/sh\n" + shlex.join(torchrun_command(spec, spec_path, task)) + "\n"}

    def submit(self, spec: JobSpec, task: str = "train") -> LaunchRecord:
        """Create the run and start its launcher detached (own session, output to logs/launcher.log)."""
        if task != "train":
            raise SpecError("--task", f"a detached local launch runs train, not {task}",
                            f"run `shardline {task}` in the foreground instead")
        from shardline.data.preflight import preflight
        from shardline.environment import check_environment

        torchrun_command(spec, Path("spec.yaml"))  # launch settings checked before anything is written
        check_environment(spec)
        preflight(spec)  # the model's location, the data's format and first rows
        if spec.run.id is not None:  # a resume (or the id the API claimed): never while the run still runs
            refuse_if_running(run_path(spec))
        spec, run_dir = create_run(spec)
        env = dict(os.environ, TOKENIZERS_PARALLELISM=os.environ.get("TOKENIZERS_PARALLELISM", "false"))
        with (run_dir / "logs" / LAUNCHER_LOG).open("ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "shardline.engines.local", str(run_dir)], env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        record_process(run_dir, proc.pid, "launcher")
        record = LaunchRecord(target="local", run_id=run_dir.name, submitted_at=_now(), job_id=str(proc.pid),
                              run_dir=str(run_dir.resolve()))
        save_record(run_dir, record)
        return record

    def status(self, record: LaunchRecord) -> JobState:
        run_dir = self._run_dir(record)
        st = read_status(run_dir)
        phase = st.outcome  # the word `runs` prints too
        reasons = [st.progress_line()]
        if st.failure:
            reasons.append(st.failure.get("message") or "failed")
        if st.status == "preempted":
            at = f"step {st.committed_step}" if st.committed_step is not None else "no checkpoint yet"
            reasons.append(f"stopped with a checkpoint ({at}); resume: shardline train {run_dir}")
        manifest = read_manifest(run_dir)
        ranks = []
        for log in sorted((run_dir / "logs").glob("rank-*.log"), key=lambda p: int(p.stem.split("-")[1])):
            rank = int(log.stem.split("-")[1])
            failed = st.failure and st.failure.get("rank") == rank
            ranks.append(RankState(rank=rank, name=manifest.get("host", ""),
                                   state="failed" if failed else st.status,
                                   detail=st.failure.get("message", "")[:200] if failed else ""))
        return JobState(phase=phase, reasons=reasons, ranks=ranks)

    def logs(self, record: LaunchRecord, rank: int | None, follow: bool) -> Iterator[str]:
        run_dir = self._run_dir(record)

        def files() -> list[tuple[str, Path]]:
            ranks = sorted((run_dir / "logs").glob("rank-*.log"), key=lambda p: int(p.stem.split("-")[1]))
            found = [(f"[rank {p.stem.split('-')[1]}] ", p) for p in ranks]
            if rank is not None:
                return [f for f in found if f[1].stem == f"rank-{rank}"]
            return [("[launcher] ", run_dir / "logs" / LAUNCHER_LOG), *found]

        yield from _follow_files(files, follow, lambda: read_status(run_dir).status not in LIVE)

    def cancel(self, record: LaunchRecord) -> None:
        """SIGTERM to the launcher (it forwards to torchrun, the workers checkpoint, exit 75)."""
        run_dir = self._run_dir(record)
        manifest = settle(run_dir)
        alive = live_processes(manifest)
        if manifest.get("status") not in LIVE or not alive:
            raise SpecError(str(run_dir), f"is not running (status {manifest.get('status')})", "nothing to cancel")
        target = next((p for p in alive if p["role"] == "launcher"), alive[0])
        os.kill(int(target["pid"]), signal.SIGTERM)

    @staticmethod
    def _run_dir(record: LaunchRecord) -> Path:
        return Path(record.run_dir) if record.run_dir else Path("runs") / record.run_id


def run_task_locally(spec: JobSpec, task: str, out: Path | None) -> int:
    """The task under `torchrun --standalone` on this machine (the local launcher's command + `--out`).

    gpucheck on a machine without CUDA runs in this process instead: there is no GPU to check per rank,
    only the CPU probe to report, and exit code 3 says so without torchrun's failure report around it.
    """
    import torch  # here, not at the top: the launcher of a training run never imports torch

    from shardline.ops.checks.runner import document_exit_code, run_gpucheck

    with tempfile.TemporaryDirectory(prefix=f"shardline-{task}-") as tmp:
        result = Path(tmp) / f"{task}.json"
        if task == "gpucheck" and not torch.cuda.is_available():
            env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(_free_port())}
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                code = run_gpucheck(spec, Console(soft_wrap=True), result)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        else:
            spec_path = Path(tmp) / "spec.yaml"
            spec_path.write_text(spec_to_yaml(spec))
            env = dict(os.environ)
            env.setdefault("TOKENIZERS_PARALLELISM", "false")
            code = subprocess.run([*torchrun_command(spec, spec_path, task), "--out", str(result)], env=env).returncode
        if not result.is_file():
            return code or EXIT_FAILURE
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(result, out)
        return document_exit_code(json.loads(result.read_text()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    """The detached launcher: `python -m shardline.engines.local RUN_DIR` (started by `LocalBackend.submit`)."""
    parser = argparse.ArgumentParser(prog="shardline.engines.local")
    parser.add_argument("run_dir", type=Path)
    run_dir = parser.parse_args(argv).run_dir
    console = Console(soft_wrap=True)
    try:
        claim_run(run_dir)  # the detached launcher is the run's one launcher while it lives
        spec = read_spec(run_dir / "spec.yaml")
        from shardline.data.prepare import prepare

        return train_run(spec, run_dir, prepare, lambda m: console.print(m, highlight=False, markup=False))
    except ShardlineError as e:
        console.print(f"error: {e}", highlight=False, markup=False)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
