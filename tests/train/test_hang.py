"""Hang detection names the rank: a SIGSTOPped worker is named (step, phase, stack top, host) within the timeout,
the live ranks' stacks are on disk, and torchrun restarts the group from the last checkpoint; a rank alive but stuck
in its own code is named too, and with no restart left the run fails with exit 76."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardline.errors import EXIT_HANG, SpecError
from shardline.failures import WorkerFailure, read_failures
from shardline.resilience.watchdog import Heartbeat, hang_message, heartbeat_interval, judge
from shardline.rundir import read_manifest
from shardline.spec.resolve import load_spec
from tests.conftest import LOADED_SLACK_S, REPO, read_metrics, small_overrides

TIMEOUT_S = 8
MARGIN_S = 3 * heartbeat_interval(TIMEOUT_S) + 0.2 + LOADED_SLACK_S
"""Above the timeout, from the watchdog's own schedule: a stall is seen at the next interval's read and confirmed by
a second read 2 intervals + 0.2 s later; then a loaded 2-core machine. Anything below the collective timeout
(1800 s) still shows the watchdog, not the collective, ended the wait."""
STEPS, EVERY = 160, 20
STUCK_AT = 140  # the step rank 1 sleeps in after the restart: past any checkpoint the first hang could resume from
STUCK_S = 300  # rank 1's injected sleep there


def _beat(rank: int, seq: int, step: int, phase: str = "training") -> Heartbeat:
    return Heartbeat(rank, seq, step, phase, time.time(), "node-a", 100 + rank, "all_reduce (distributed_c10d.py:1)")


def test_a_heartbeat_that_stops_names_its_rank_before_one_that_is_merely_behind():
    first = {0: _beat(0, 5, 7), 1: _beat(1, 9, 6), 2: _beat(2, 3, 7)}
    second = {0: _beat(0, 7, 7), 1: _beat(1, 11, 6), 2: _beat(2, 3, 7)}  # rank 2's seq stood still
    verdict = judge(first, second, world=4)  # rank 3 never published
    assert verdict.stopped == [2, 3] and verdict.behind == [1] and verdict.culprits == [2, 3]
    message = hang_message(verdict, 30, time.time())
    assert message.startswith("hang: rank(s) 2, 3 stopped arriving")
    assert "rank 2 — last heartbeat" in message and "step 7, training, at all_reduce" in message
    assert "rank 3 never sent a heartbeat" in message and "on node-a (pid 102)" in message


def test_without_a_stopped_heartbeat_the_rank_behind_is_named_and_else_nobody():
    first = {0: _beat(0, 1, 4), 1: _beat(1, 1, 3)}
    second = {0: _beat(0, 2, 4), 1: _beat(1, 2, 3)}
    assert judge(first, second, 2).culprits == [1]
    assert "rank(s) 1 alive but behind" in hang_message(judge(first, second, 2), 30, time.time())
    level = {0: _beat(0, 2, 4), 1: _beat(1, 2, 4)}  # both inside the collective
    assert judge(first | {1: _beat(1, 1, 4)}, level, 2).culprits == []
    assert "every rank waits at the same place" in hang_message(judge(level, {0: _beat(0, 3, 4),
                                                                             1: _beat(1, 3, 4)}, 2), 30, 0)


def test_at_the_same_step_the_rank_outside_the_collective_the_others_wait_in_is_named():
    beats = {0: _beat(0, 1, 4), 1: Heartbeat(1, 1, 4, "training", 0.0, "node-b", 7, "maybe_fail (faults.py:60)")}
    later = {r: Heartbeat(**{**vars(hb), "seq": 2}) for r, hb in beats.items()}
    verdict = judge(beats, later, 2)
    assert verdict.stopped == verdict.behind == [] and verdict.culprits == [1]
    assert "rank(s) 1 alive but outside the collective" in hang_message(verdict, 30, 0)


def test_hang_timeout_is_validated_and_sets_the_heartbeat_interval():
    assert load_spec("tiny", ["launch.hang_timeout_seconds=0"]).launch.hang_timeout_seconds == 0
    for bad in ("2", "-1", "5000"):
        with pytest.raises(SpecError) as e:
            load_spec("tiny", [f"launch.hang_timeout_seconds={bad}"])
        assert e.value.field == "launch.hang_timeout_seconds"
    assert heartbeat_interval(8) == 0.8 and heartbeat_interval(600) == 5.0 and heartbeat_interval(5) == 0.5


def _wait(predicate, what: str, timeout: float, proc: subprocess.Popen, log) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (found := predicate()) is not None:
            return found
        if proc.poll() is not None:
            pytest.fail(f"the run ended ({proc.returncode}) before {what}:\n{log.read_text()[-4000:]}")
        time.sleep(0.1)
    pytest.fail(f"no {what} within {timeout}s:\n{log.read_text()[-4000:]}")


def _events(run_dir, name: str) -> list[dict]:
    if not (run_dir / "metrics.jsonl").exists():
        return []
    return [e for e in read_metrics(run_dir, "event") if e.get("event") == name]


def _step_with_checkpoint(run_dir, step: int):
    trains = read_metrics(run_dir, "train") if (run_dir / "metrics.jsonl").exists() else []
    if trains and trains[-1]["step"] >= step and _events(run_dir, "checkpoint_committed"):
        return trains[-1]["step"]
    return None


@dataclass
class TwoHangs:
    run_dir: Path
    console: str
    exit_code: int
    ended: float
    stopped_pid: int
    stopped_at: float
    first_stack_rank_0: str
    first_failure: WorkerFailure
    """rank 0's stack dump and rank 1's failure record of the first hang (the second hang's replace them)."""


@pytest.fixture(scope="module")
def two_hangs(tmp_path_factory) -> TwoHangs:
    """One run, two hangs: the test SIGSTOPs rank 1 after step 30 of the first attempt; in the group torchrun then
    restarts (launch.max_restarts=1), a drill has rank 1 sleep inside step 140 (alive, heartbeat still beating)
    while rank 0 waits in a collective; with no restart left, the run ends."""
    tmp = tmp_path_factory.mktemp("hangs")
    runs = tmp / "runs"
    sets = [*small_overrides(runs), "parallel.nproc_per_node=2", "train.precision=fp32", f"train.max_steps={STEPS}",
            f"checkpoint.every_steps={EVERY}", f"launch.hang_timeout_seconds={TIMEOUT_S}", "launch.max_restarts=1",
            "launch.grace_seconds=3", "observe.metrics_port=null", "observe.report=false"]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false",
               SHARDLINE_FAULT=f"train_step:rank=1:step={STUCK_AT}:action=slow:seconds={STUCK_S}:restart=1")
    log = tmp / "console.txt"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "shardline.cli", "train", "tiny",
                                 *[a for kv in sets for a in ("--set", kv)]], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    stopped_pid = None
    try:
        run_dir = _wait(lambda: next((p.parent for p in runs.glob("*/spec.yaml")), None), "run directory", 120,
                        proc, log)
        _wait(lambda: _step_with_checkpoint(run_dir, 30), "step 30 with a committed checkpoint", 240, proc, log)
        time.sleep(2 * heartbeat_interval(TIMEOUT_S))  # a heartbeat from the loop, not from before it
        ranks = {p["role"]: p["pid"] for p in read_manifest(run_dir)["processes"]}
        stopped_pid = ranks["rank 1"]
        os.kill(stopped_pid, signal.SIGSTOP)
        stopped_at = time.time()
        _wait(lambda: next(iter(_events(run_dir, "hang")), None), "hang event", TIMEOUT_S + 60, proc, log)
        first_stack = (run_dir / "logs" / "stack-rank-0.txt").read_text()  # written before the event
        _wait(lambda: read_manifest(run_dir).get("hangs"), "the hang in the manifest", 60, proc, log)  # written last
        [first_failure] = [f for f in read_failures(run_dir) if f.error_type == "HangDetected"]
        exit_code = proc.wait(timeout=STUCK_S - 60)
        ended = time.time()
    finally:
        if stopped_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped_pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    return TwoHangs(run_dir, log.read_text(), exit_code, ended, stopped_pid, stopped_at, first_stack,
                    first_failure)


@pytest.mark.slow
def test_a_sigstopped_rank_is_named_with_its_host_and_the_run_restarts_from_the_checkpoint(two_hangs):
    run_dir, console, hang = two_hangs.run_dir, two_hangs.console, _events(two_hangs.run_dir, "hang")[0]
    detected_s = hang["time"] - two_hangs.stopped_at
    # named within the timeout and a margin, by its heartbeat having stopped: where and on which host. Earlier than
    # the timeout by at most the second rank 0 may already have waited in a collective before the SIGSTOP
    assert TIMEOUT_S - 1 <= detected_s <= TIMEOUT_S + MARGIN_S, (detected_s, console[-3000:])
    assert hang["ranks"] == [1] and hang["stopped"] == [1] and hang["reported_by"] == 0
    where = hang["where"]["1"]
    assert where["host"] == socket.gethostname() and where["pid"] == two_hangs.stopped_pid and where["step"] >= 30
    assert where["phase"] in ("training", "checkpoint", "validation") and "(" in where["stack_top"]
    assert "error: rank 0: hang: rank(s) 1 stopped arriving" in console
    assert "hang: rank(s) 1 stopped arriving" in (run_dir / "logs" / "rank-0.log").read_text()
    # the live rank's stacks, every thread, on disk
    stack = two_hangs.first_stack_rank_0
    assert "Thread" in stack and "shardline-watchdog" not in stack.splitlines()[0]
    assert "trainer.py" in stack or "checkpoint.py" in stack
    # the failure record and the manifest name it; the run's own exit code restarts it
    failure = two_hangs.first_failure
    assert failure.rank == 1 and failure.host == socket.gethostname() and failure.committed_step is not None
    first = read_manifest(run_dir)["hangs"][0]
    assert first["ranks"] == [1] and first["attempt"] == 0
    assert f"exited with code {EXIT_HANG}" not in console  # told as a hang, not as an exit code
    # resumed from the last committed checkpoint and trained on (to the drill of the second hang)
    [resume] = [e for e in _events(run_dir, "resume") if e["time"] > hang["time"]]
    assert resume["step"] == failure.committed_step
    after = [r for r in read_metrics(run_dir, "train") if r["time"] > resume["time"]]
    assert after[0]["step"] == resume["step"] + 1 and after[-1]["step"] == STUCK_AT - 1
    first_step_s = after[0]["time"] - hang["time"]
    print(f"\nSIGSTOP → hang event {detected_s:.1f}s (timeout {TIMEOUT_S}s); hang event → resume "
          f"{resume['time'] - hang['time']:.1f}s → first step {first_step_s:.1f}s")


@pytest.mark.slow
def test_a_rank_stuck_in_its_own_code_is_named_and_without_restarts_the_run_fails_with_exit_76(two_hangs):
    """Rank 1 sleeps inside step 140 of the restarted group (no restart left) while rank 0 waits in a collective:
    both dump their stacks, rank 1 is named as outside the collective, and the run's failure record and exit code
    say hang."""
    run_dir, console = two_hangs.run_dir, two_hangs.console
    assert two_hangs.exit_code == EXIT_HANG, console[-3000:]
    [_, hang] = _events(run_dir, "hang")
    # orderings from the last step done (139) instead of a bound on the whole run, whose startup a loaded machine
    # stretches: the hang is named within the timeout and its margin, and the run ended before rank 1's sleep did
    # (nobody waited for it, or for the 1800 s collective timeout)
    last_step_at = read_metrics(run_dir, "train")[-1]["time"]
    assert TIMEOUT_S <= hang["time"] - last_step_at <= TIMEOUT_S + MARGIN_S, (hang["time"] - last_step_at)
    assert two_hangs.ended - last_step_at < STUCK_S
    assert hang["ranks"] == [1] and hang["stopped"] == [] and hang["where"]["1"]["step"] == STUCK_AT - 1
    assert "maybe_fail (faults.py" in hang["where"]["1"]["stack_top"]
    for rank, frame in ((0, "distributed_c10d.py"), (1, "faults.py")):  # every live rank's stack, on disk
        assert frame in (run_dir / "logs" / f"stack-rank-{rank}.txt").read_text()
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "failed" and manifest["exit_code"] == EXIT_HANG
    failure = manifest["failure"]
    assert failure["rank"] == 1 and failure["error_type"] == "HangDetected"
    assert failure["committed_step"] == (STUCK_AT - 1) // EVERY * EVERY
    assert f"rank 1 failed while training in step {STUCK_AT} of {STEPS}: HangDetected: hang: rank(s) 1 alive but " \
           "outside the collective" in failure["message"]
    assert console.count("hang: rank(s) 1") >= 2 and "Traceback" not in console
